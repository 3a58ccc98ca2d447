//! Routers in-process for tests: [`TestRouter`] (built from a TOML string)
//! and [`FileRouter`] (reading a config file it can be told to reload), both
//! built with [`lockrouter::Application`] on a free port and stopped on drop.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lockrouter::{Application, Settings};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::api::{Api, Reply};
use crate::config::config_toml;
use crate::etcd::EtcdCluster;
use crate::sleep_ms;

pub struct TestRouter {
    /// Its HTTP API on the port it bound.
    pub api: Api,
    /// The settings it was built from.
    pub settings: Settings,
    /// Cancelled on drop: the router drains and stops.
    shutdown: CancellationToken,
}

impl TestRouter {
    pub async fn start(shards: &[&EtcdCluster]) -> Self {
        Self::with_toml(&config_toml(shards, "127.0.0.1:0", "")).await
    }

    pub async fn with_toml(toml: &str) -> Self {
        let router = Self::spawn(toml).await;
        router.api.wait_ready().await;
        router
    }

    /// A router that runs, whether or not it ever becomes ready.
    pub async fn spawn(toml: &str) -> Self {
        let settings = Settings::from_toml(toml).expect("test config is valid");
        let app = Application::build(settings.clone())
            .await
            .expect("router builds");
        let addr = app.local_addr();
        let shutdown = CancellationToken::new();
        tokio::spawn(app.run(shutdown.clone()));
        Self {
            api: Api::new(addr),
            settings,
            shutdown,
        }
    }
}

impl Drop for TestRouter {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A router in-process reading its config from a file it can be told to
/// reload (`POST /admin/v1/reload`) or that it polls for changes.
pub struct FileRouter {
    /// Its HTTP API on the port it bound.
    pub api: Api,
    /// The config file; write it and [`reload`](Self::reload).
    pub path: PathBuf,
    /// Cancelled on drop: the router drains and stops.
    shutdown: CancellationToken,
    /// Holds the config file.
    _dir: tempfile::TempDir,
}

impl FileRouter {
    pub async fn start(toml: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("router.toml");
        std::fs::write(&path, toml).unwrap();
        let settings = Settings::load(&path).expect("test config is valid");
        let app = Application::build_from(settings, Some(path.clone()))
            .await
            .expect("router builds");
        let api = Api::new(app.local_addr());
        let shutdown = CancellationToken::new();
        tokio::spawn(app.run(shutdown.clone()));
        api.wait_ready().await;
        Self {
            api,
            path,
            shutdown,
            _dir: dir,
        }
    }

    /// Writes a new config and reloads it through the admin route.
    pub async fn reload(&self, toml: &str) -> Reply {
        self.reload_as(&self.api, toml).await
    }

    /// [`reload`](Self::reload) through `admin` (an [`Api`] carrying the
    /// admin's credentials).
    pub async fn reload_as(&self, admin: &Api, toml: &str) -> Reply {
        std::fs::write(&self.path, toml).unwrap();
        admin.post("/admin/v1/reload", serde_json::json!({})).await
    }

    pub async fn ring(&self) -> Value {
        self.api.get("/admin/v1/ring").await.body
    }

    /// Waits until the router sees no open migration and grants.
    pub async fn wait_migration_closed(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let ring = self.ring().await;
            if ring["migration"].is_null() && ring["granting"] == true {
                return;
            }
            assert!(Instant::now() < deadline, "migration still open: {ring}");
            sleep_ms(100).await;
        }
    }
}

impl Drop for FileRouter {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
