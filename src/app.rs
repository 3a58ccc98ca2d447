//! Building and running a router: bind the listeners (port 0 works, and the
//! real address is reported), connect the shards, serve until shutdown,
//! reloading the config on SIGHUP or when its file changes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::generation::{BuildError, Generation, InForce};
use crate::http::{self, AppState, Listener};
use crate::placement::topology::{ConnectError, ShardPool};
use crate::reload::Reloader;

/// A router that is bound and connected, ready to [`run`](Self::run).
pub struct Application {
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    state: Arc<AppState>,
    grace: Duration,
    /// How often the config file is checked for changes; `None`: never.
    reload_poll: Option<Duration>,
    /// Stops the shard tasks (monitor, keepalive, verification) on drop.
    tasks: CancellationToken,
    /// Folds histogram samples on a timer, scraped or not.
    _upkeep: crate::task::TaskGuard,
}

impl Application {
    /// A router over `settings`, without a config file to reload from.
    pub async fn build(settings: Settings) -> Result<Self, StartError> {
        Self::build_from(settings, None).await
    }

    /// A router over `settings`, read from `path` (reloaded on change).
    pub async fn build_from(settings: Settings, path: Option<PathBuf>) -> Result<Self, StartError> {
        // First: series set while connecting (a shard's first answer marks
        // it up, once) would otherwise go to no recorder and stay missing.
        let metrics = crate::metrics::install();
        let listener = bind(&settings.server.listen).await?;
        let metrics_listener = match &settings.server.metrics_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let tasks = CancellationToken::new();
        let pool = ShardPool::new(&settings, tasks.clone());
        let first = Generation::build(&settings, None, async {
            Ok::<_, StartError>(crate::placement::serve(&settings, pool.clone()).await?)
        })
        .await?;
        let in_force = Arc::new(InForce::new(
            first,
            crate::http::admission::per_shard_acquires(settings.server.max_in_flight),
        ));
        let reloader = Arc::new(Reloader::new(
            path,
            settings.clone(),
            in_force.clone(),
            pool,
        ));
        let upkeep = crate::metrics::start_upkeep(metrics.clone(), crate::metrics::UPKEEP_EVERY);
        let state = Arc::new(AppState {
            in_force,
            reloader,
            metrics,
            admission: crate::http::admission::Admission::new(settings.server.max_in_flight),
            failures: Default::default(),
            replica: crate::http::answers::Replica::starting(),
        });
        Ok(Self {
            listener,
            metrics_listener,
            state,
            grace: settings.server.shutdown_grace(),
            reload_poll: settings.admin.reload_poll(),
            tasks,
            _upkeep: upkeep,
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
            let state = self.state.clone();
            tokio::spawn(http::serve(
                l,
                state,
                Listener::MetricsOnly,
                shutdown.clone(),
                grace,
            ))
        });
        // Not polled: SIGHUP and the admin route still reload.
        let poll = self.reload_poll.unwrap_or(Duration::MAX / 4);
        let watcher = tokio::spawn(
            self.state
                .reloader
                .clone()
                .watch(poll, self.tasks.child_token()),
        );
        http::serve(self.listener, self.state, Listener::Main, shutdown, grace).await;
        if let Some(task) = metrics {
            let _ = task.await;
        }
        self.tasks.cancel();
        let _ = watcher.await;
    }
}

async fn bind(addr: &str) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Listen {
            addr: addr.to_string(),
            source,
        })
}

/// Why a router could not start. Each message names the setting or the
/// address at fault; the error it comes of is its source.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Shard(#[from] ConnectError),
    /// A TLS file of `[server]`, or a lockId key of `[auth]`, cannot be
    /// used.
    #[error(transparent)]
    Build(#[from] BuildError),
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;

    #[tokio::test]
    async fn a_start_error_names_the_problem_and_keeps_its_source() {
        let settings = Settings::from_toml(
            r#"
            [server]
            listen = "127.0.0.1:0"
            [[auth.lock_id_keys]]
            id = "k1"
            secret_file = "/nonexistent/lockid.key"
            [[shards]]
            name = "a"
            endpoints = ["http://127.0.0.1:1"]
            "#,
        )
        .unwrap();
        let Err(e) = Application::build(settings).await else {
            panic!("started with an unreadable key file");
        };
        let shown = e.to_string();
        assert!(
            shown.contains("auth.lock_id_keys \"k1\"") && shown.contains("/nonexistent/lockid.key"),
            "{shown}"
        );
        assert!(matches!(e, StartError::Build(BuildError::Auth(_))), "{e:?}");
        let io = std::iter::successors(e.source(), |e| (*e).source())
            .find_map(|e| e.downcast_ref::<std::io::Error>())
            .expect("the read's io::Error is in the chain");
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    }
}
