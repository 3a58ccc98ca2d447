//! Building and running a router: bind the listeners (port 0 works, and the
//! real address is reported), connect the shards, serve until shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::http::{self, AppState, Listener};
use crate::locks::Locks;
use crate::router::Router;

/// A router that is bound and connected, ready to [`run`](Self::run).
pub struct Application {
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    state: Arc<AppState>,
    grace: Duration,
    /// Stops the shard tasks (monitor, keepalive, verification) on drop.
    tasks: CancellationToken,
}

impl Application {
    pub async fn build(settings: Settings) -> Result<Self, String> {
        let listener = bind(&settings.server.listen).await?;
        let metrics_listener = match &settings.server.metrics_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let tasks = CancellationToken::new();
        let router = Router::start(&settings, &tasks).await?;
        let locks = Locks::new(
            router,
            settings.limits.clone(),
            Duration::from_millis(settings.etcd.keepalive_coalesce_ms),
        );
        let state = Arc::new(AppState {
            locks,
            metrics: crate::metrics::install(),
        });
        Ok(Self {
            listener,
            metrics_listener,
            state,
            grace: Duration::from_millis(settings.server.shutdown_grace_ms),
            tasks,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// Serves until `shutdown` is cancelled, then drains in-flight requests.
    pub async fn run(self, shutdown: CancellationToken) {
        let grace = self.grace;
        let metrics = self.metrics_listener.map(|l| {
            tokio::spawn(http::serve(
                l,
                self.state.clone(),
                Listener::MetricsOnly,
                shutdown.clone(),
                grace,
            ))
        });
        http::serve(self.listener, self.state, Listener::Main, shutdown, grace).await;
        if let Some(task) = metrics {
            let _ = task.await;
        }
        self.tasks.cancel();
    }
}

async fn bind(addr: &str) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))
}
