//! One connection to one etcd cluster: every RPC lockrouter makes goes
//! through [`EtcdConn::call`], which applies the shard's deadline, classifies
//! errors, records metrics and keeps the shard's up/down flag current.
//! Cheap to clone (the etcd client is a handle to a shared channel).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};

use crate::metrics as m;

/// Why an etcd call failed, as far as callers need to know.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EtcdError {
    /// Unreachable, no leader, or past the deadline: retry later.
    #[error("shard {shard} unavailable: {detail}")]
    Unavailable { shard: String, detail: String },
    /// The lease named in the request no longer exists.
    #[error("lease not found")]
    LeaseNotFound,
    /// Anything else etcd refused; a bug or a misconfigured cluster.
    #[error("etcd error on shard {shard}: {detail}")]
    Other { shard: String, detail: String },
}

struct Inner {
    shard: String,
    client: Client,
    timeout: Duration,
    /// False after a call failed for unavailability, until a probe succeeds.
    up: AtomicBool,
}

#[derive(Clone)]
pub struct EtcdConn {
    inner: Arc<Inner>,
}

impl EtcdConn {
    /// Builds the client; no connection is made until the first call, so a
    /// shard that is down at start-up does not stop the router.
    pub async fn connect(
        shard: &str,
        endpoints: &[String],
        timeout: Duration,
        connect_timeout: Duration,
    ) -> Result<Self, etcd_client::Error> {
        let options = ConnectOptions::new()
            .with_connect_timeout(connect_timeout)
            // HTTP/2 pings notice a dead member even when no call is running.
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let client = Client::connect(endpoints, Some(options)).await?;
        m::shard_up(shard, false);
        Ok(Self {
            inner: Arc::new(Inner {
                shard: shard.to_string(),
                client,
                timeout,
                up: AtomicBool::new(false),
            }),
        })
    }

    pub fn shard(&self) -> &str {
        &self.inner.shard
    }

    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    pub fn is_up(&self) -> bool {
        self.inner.up.load(Ordering::Relaxed)
    }

    pub fn set_up(&self, up: bool) {
        if self.inner.up.swap(up, Ordering::Relaxed) != up {
            m::shard_up(&self.inner.shard, up);
            if up {
                tracing::info!(shard = %self.inner.shard, "shard is reachable");
            } else {
                tracing::warn!(shard = %self.inner.shard, "shard is unavailable");
            }
        }
    }

    pub fn unavailable(&self, detail: impl Into<String>) -> EtcdError {
        EtcdError::Unavailable {
            shard: self.inner.shard.clone(),
            detail: detail.into(),
        }
    }

    /// Runs one etcd RPC under the shard's deadline.
    pub async fn call<T, F>(&self, rpc: &'static str, fut: F) -> Result<T, EtcdError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.inner.timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.classify(e)),
            Err(_) => Err(self.unavailable(format!(
                "no answer within {} ms",
                self.inner.timeout.as_millis()
            ))),
        };
        let outcome = match &result {
            Ok(_) => "ok",
            Err(EtcdError::LeaseNotFound) => "lease_not_found",
            Err(EtcdError::Unavailable { .. }) => "unavailable",
            Err(EtcdError::Other { .. }) => "error",
        };
        m::etcd_rpc(&self.inner.shard, rpc, outcome, started.elapsed());
        if let Err(EtcdError::Unavailable { detail, .. }) = &result {
            tracing::debug!(shard = %self.inner.shard, rpc, %detail, "etcd call failed");
            self.set_up(false);
        }
        result
    }

    pub fn classify(&self, e: etcd_client::Error) -> EtcdError {
        use etcd_client::Error as E;
        use tonic_code::*;
        match e {
            E::GRpcStatus(s) if s.message().contains("lease not found") => EtcdError::LeaseNotFound,
            E::LeaseKeepAliveError(msg) if msg.contains("lease not found") => {
                EtcdError::LeaseNotFound
            }
            E::GRpcStatus(s) if UNAVAILABLE_CODES.contains(&(s.code() as i32)) => {
                self.unavailable(s.message().to_string())
            }
            E::TransportError(t) => self.unavailable(t.to_string()),
            E::IoError(io) => self.unavailable(io.to_string()),
            E::LeaseKeepAliveError(msg) | E::WatchError(msg) => self.unavailable(msg),
            other => EtcdError::Other {
                shard: self.inner.shard.clone(),
                detail: other.to_string(),
            },
        }
    }
}

/// gRPC status codes (numbers fixed by the gRPC spec) that mean "try again".
mod tonic_code {
    pub const UNAVAILABLE_CODES: [i32; 5] = [
        1,  // Cancelled
        2,  // Unknown: transport errors surface as Unknown in tonic
        4,  // DeadlineExceeded
        8,  // ResourceExhausted
        14, // Unavailable (no leader, member stopping, connection refused)
    ];
}
