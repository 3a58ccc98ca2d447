//! Routers for tests: in-process (`TestRouter`, stopped on drop) or as a
//! child process of the real binary (`RouterProcess`, killed on drop), plus
//! a small JSON client for the v1 API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockrouter::{Application, Settings};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::etcd::EtcdCluster;

/// TOML for a router on a free port over `shards` named a, b, c, ...
pub fn config_toml(shards: &[&EtcdCluster], listen: &str, extra: &str) -> String {
    let mut toml = format!(
        "[server]\nlisten = \"{listen}\"\n\n[etcd]\nprefix = \"/lockrouter\"\n\
         request_timeout_ms = 1000\nconnect_timeout_ms = 500\nhealth_interval_ms = 200\n{extra}\n"
    );
    for (i, s) in shards.iter().enumerate() {
        let eps: Vec<String> = s.endpoints().iter().map(|e| format!("\"{e}\"")).collect();
        toml.push_str(&format!(
            "\n[[shards]]\nname = \"{}\"\nendpoints = [{}]\n",
            shard_name(i),
            eps.join(", ")
        ));
    }
    toml
}

pub fn shard_name(i: usize) -> String {
    ((b'a' + i as u8) as char).to_string()
}

pub struct TestRouter {
    pub api: Api,
    pub settings: Settings,
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

/// A router in-process reading its config from a file it can be told to
/// reload (`POST /admin/v1/reload`) or that it polls for changes.
pub struct FileRouter {
    pub api: Api,
    pub path: std::path::PathBuf,
    shutdown: CancellationToken,
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
        std::fs::write(&self.path, toml).unwrap();
        self.api
            .post("/admin/v1/reload", serde_json::json!({}))
            .await
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

impl Drop for TestRouter {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The `lockrouter` binary running `serve` on a config file.
pub struct RouterProcess {
    pub child: Child,
    pub api: Api,
    pub log: PathBuf,
    pub config: PathBuf,
    _dir: tempfile::TempDir,
}

impl RouterProcess {
    pub async fn start(shards: &[&EtcdCluster], port: u16) -> Self {
        Self::start_with(shards, port, "").await
    }

    /// Like `start`, with `extra` TOML after the `[etcd]` keys.
    pub async fn start_with(shards: &[&EtcdCluster], port: u16, extra: &str) -> Self {
        let listen = format!("127.0.0.1:{port}");
        let p = Self::spawn(&config_toml(shards, &listen, extra), port);
        p.api.wait_ready().await;
        p
    }

    /// The binary serving `toml` (which must listen on `port`), whether or
    /// not it ever becomes ready.
    pub fn spawn(toml: &str, port: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("router.toml");
        let listen = format!("127.0.0.1:{port}");
        std::fs::write(&config, toml).unwrap();
        let log = dir.path().join("router.log");
        let child = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start lockrouter");
        let api = Api::new(listen.parse().unwrap());
        Self {
            child,
            api,
            log,
            config,
            _dir: dir,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A status code and a JSON body (Null when empty).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub retry_after: Option<String>,
}

#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub http: reqwest::Client,
}

impl Api {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            base: format!("http://{addr}"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap(),
        }
    }

    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(r) = self.http.get(format!("{}/readyz", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            sleep_ms(50).await;
        }
        panic!("router at {} did not become ready", self.base);
    }

    pub async fn send(&self, req: reqwest::RequestBuilder) -> Reply {
        let resp = req.send().await.expect("request reaches the router");
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let text = resp.text().await.unwrap();
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).expect("JSON body")
        };
        Reply {
            status,
            body,
            retry_after,
        }
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.send(self.http.post(format!("{}{path}", self.base)).json(&body))
            .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(self.http.get(format!("{}{path}", self.base)))
            .await
    }

    pub async fn acquire(&self, name: &str, ttl_ms: u64, client: &str) -> Reply {
        self.post(
            "/api/v1/locks/acquire",
            json!({"name": name, "ttlMs": ttl_ms, "clientId": client}),
        )
        .await
    }

    /// Acquires and asserts the grant; returns `(lockId, token)`.
    pub async fn must_acquire(&self, name: &str, ttl_ms: u64, client: &str) -> (String, u64) {
        let r = self.acquire(name, ttl_ms, client).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            r.body["acquired"], true,
            "{name} should be granted to {client}: {r:?}"
        );
        (
            r.body["lockId"].as_str().unwrap().to_string(),
            r.body["fencingToken"].as_u64().unwrap(),
        )
    }

    pub async fn renew(&self, lock: &(String, u64)) -> Reply {
        self.post(
            "/api/v1/locks/renew",
            json!({"lockId": lock.0, "fencingToken": lock.1}),
        )
        .await
    }

    pub async fn release(&self, lock: &(String, u64)) -> Reply {
        self.post(
            "/api/v1/locks/release",
            json!({"lockId": lock.0, "fencingToken": lock.1}),
        )
        .await
    }

    /// The router's Prometheus text.
    pub async fn metrics(&self) -> String {
        let resp = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap();
        resp.text().await.unwrap()
    }

    pub async fn inspect(&self, name: &str) -> Reply {
        let enc = percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC);
        self.get(&format!("/api/v1/locks/{enc}")).await
    }
}

/// Sleeps `ms` milliseconds.
pub async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await
}
