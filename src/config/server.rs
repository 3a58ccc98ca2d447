//! `[server]`: where and how the HTTP API is served, its deadlines and its
//! bound on requests in flight, and the durations they give.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::validate::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Address of the main listener (API, health, metrics).
    pub listen: String,
    /// Optional second listener that serves only `/metrics`.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// PEM certificate chain for TLS on the main listener (with
    /// `tls_key_file`); without it the listener speaks plain HTTP. Read at
    /// start and at every config reload (new connections get the new one).
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA certificates: with it, clients must present a certificate
    /// signed by one of them (mTLS). Needs `tls_cert_file`.
    #[serde(default)]
    pub tls_client_ca_file: Option<PathBuf>,
    /// How long a graceful shutdown waits for in-flight requests.
    #[serde(default = "defaults::shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// Longest wait for a request's headers (HTTP/1), counted from when
    /// the connection is ready for a request: a slow client cannot hold a
    /// connection, and an idle keep-alive connection is closed after it.
    #[serde(default = "defaults::header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// Longest time to receive a request's whole body.
    #[serde(default = "defaults::body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// Deadline of a whole request (a waiting acquire gets its `waitMs`
    /// on top); past it the answer is 504 `timeout`.
    #[serde(default = "defaults::request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Lock API requests (acquire, renew, renew-batch, release, inspect) a
    /// replica serves at once; beyond it, 503 `overloaded` at once.
    /// Acquires and inspects may use half of them, releases 90% (the
    /// acquires' share included), renewals all: the releases of admitted
    /// acquires and the renewals of held locks find room. Read at start.
    #[serde(default = "defaults::max_in_flight")]
    pub max_in_flight: usize,
    /// Threads that serve requests and talk to etcd; 0: one per core.
    /// Where the router shares its cores with etcd or other busy
    /// processes, 1 spends less CPU per request (no hand-offs between
    /// threads) at the cost of at most one core of throughput. Read at
    /// start.
    #[serde(default)]
    pub worker_threads: usize,
    /// Renewals first: once renewals on a shard take longer than this (two,
    /// and a tenth of those in a quarter second), its acquires are refused
    /// with 503 `overloaded` for a second; renewals never are. 0: off.
    #[serde(default = "defaults::renewal_budget_ms")]
    pub renewal_budget_ms: u64,
    /// One info line per HTTP request, target `lockrouter::access` (see
    /// `src/http/access.rs` for its fields). Applies at once on reload.
    #[serde(default)]
    pub access_log: bool,
}

/// How long the HTTP server waits for each part of a request.
#[derive(Debug, Clone, Copy)]
pub struct HttpTimeouts {
    pub header_read: Duration,
    pub body_read: Duration,
    pub request: Duration,
}

impl ServerSettings {
    /// The HTTP server's deadlines.
    pub fn timeouts(&self) -> HttpTimeouts {
        let ms = Duration::from_millis;
        HttpTimeouts {
            header_read: ms(self.header_read_timeout_ms),
            body_read: ms(self.body_read_timeout_ms),
            request: ms(self.request_timeout_ms),
        }
    }

    /// How long a graceful shutdown waits for in-flight requests.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }

    /// Renewals slower than this make their shard shed acquires (zero:
    /// never).
    pub fn renewal_budget(&self) -> Duration {
        Duration::from_millis(self.renewal_budget_ms)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        parse_addr("server.listen", &self.listen)?;
        if let Some(addr) = &self.metrics_listen {
            parse_addr("server.metrics_listen", addr)?;
        }
        if !(5..=1_000_000).contains(&self.max_in_flight) {
            return Err(invalid(format!(
                "server.max_in_flight = {} must be 5..=1000000",
                self.max_in_flight
            )));
        }
        if self.worker_threads > 1_024 {
            return Err(invalid(format!(
                "server.worker_threads = {} must be 0 (one per core) to 1024",
                self.worker_threads
            )));
        }
        if self.renewal_budget_ms > 600_000 {
            return Err(invalid(format!(
                "server.renewal_budget_ms = {} must be 0 (off) to 600000",
                self.renewal_budget_ms
            )));
        }
        for (key, v) in [
            ("server.shutdown_grace_ms", self.shutdown_grace_ms.max(10)),
            ("server.header_read_timeout_ms", self.header_read_timeout_ms),
            ("server.body_read_timeout_ms", self.body_read_timeout_ms),
            ("server.request_timeout_ms", self.request_timeout_ms),
        ] {
            if !(10..=600_000).contains(&v) {
                return Err(invalid(format!("{key} = {v} must be 10..=600000")));
            }
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(invalid(
                "server.tls_cert_file and server.tls_key_file go together: set both or neither",
            ));
        }
        if self.tls_client_ca_file.is_some() && self.tls_cert_file.is_none() {
            return Err(invalid(
                "server.tls_client_ca_file needs server.tls_cert_file and server.tls_key_file",
            ));
        }
        Ok(())
    }
}

fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| invalid(format!("{key} = {value:?} is not an IP:port address")))
}

mod defaults {
    pub fn shutdown_grace_ms() -> u64 {
        10_000
    }
    pub fn header_read_timeout_ms() -> u64 {
        10_000
    }
    pub fn body_read_timeout_ms() -> u64 {
        10_000
    }
    pub fn request_timeout_ms() -> u64 {
        30_000
    }
    pub fn renewal_budget_ms() -> u64 {
        500
    }
    pub fn max_in_flight() -> usize {
        20_000
    }
}
