//! The `lockrouter` binary as a child process, serving a config file in its
//! own temp dir: killed and reaped on drop. Tests start it from the binary
//! cargo built beside them and wait with the async [`Api`]; the load tests
//! name the binary, make it die with them, and wait, scrape, rewrite its
//! config and reload it with blocking calls.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use crate::api::Api;
use crate::child::{die_with_parent, log_tail, poll_until};
use crate::config::config_toml;
use crate::etcd::EtcdCluster;
use crate::loopback;
use crate::Error;

pub struct RouterProcess {
    /// The process: tests kill it, signal it and wait for it.
    pub child: Child,
    /// The HTTP API on `port`, for tests.
    pub api: Api,
    /// Its port on 127.0.0.1 (its config's `server.listen`).
    pub port: u16,
    /// Its stderr: everything it logs.
    pub log: PathBuf,
    /// The config file it serves; rewrite it, then reload.
    pub config: PathBuf,
    /// Holds the config and the log; removed after the process is reaped.
    _dir: TempDir,
}

/// How the binary is started: which binary, extra environment, and whether
/// it dies with this process.
pub struct RouterBuilder {
    /// See [`binary`](Self::binary).
    binary: PathBuf,
    /// Set on top of this process's environment, which the router inherits.
    env: Vec<(OsString, OsString)>,
    /// See [`die_with_parent`](Self::die_with_parent).
    die_with_parent: bool,
    /// See [`log_to`](Self::log_to).
    log: Option<PathBuf>,
}

impl RouterBuilder {
    /// Appends the router's stderr to `path` instead of a log in its own
    /// temp dir, so the log outlives the process: a test that kills and
    /// starts a router again keeps every generation's log in one file.
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some(path.into());
        self
    }

    /// Runs `binary` instead of the one cargo built beside this executable.
    pub fn binary(mut self, binary: impl Into<PathBuf>) -> Self {
        self.binary = binary.into();
        self
    }

    /// Sets an environment variable of the process (e.g. `RUST_LOG`).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The kernel kills the router if this process dies, even by SIGKILL;
    /// see [`child::die_with_parent`](crate::child::die_with_parent) for which
    /// thread must start it.
    pub fn die_with_parent(mut self) -> Self {
        self.die_with_parent = true;
        self
    }

    /// Starts `lockrouter serve` on `toml` (which must listen on
    /// 127.0.0.1:`port`), without waiting for it to become ready.
    pub fn spawn(self, toml: &str, port: u16) -> Result<RouterProcess, Error> {
        let dir = tempfile::tempdir().map_err(Error::prepare("the router's temp dir"))?;
        let config = dir.path().join("router.toml");
        std::fs::write(&config, toml).map_err(Error::prepare("the router's config"))?;
        let (log, stderr) = match self.log {
            Some(log) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log);
                (log, file)
            }
            None => {
                let log = dir.path().join("router.log");
                let file = std::fs::File::create(&log);
                (log, file)
            }
        };
        let stderr = stderr.map_err(Error::prepare("the router's log"))?;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("serve")
            .arg("--config")
            .arg(&config)
            .envs(self.env)
            .stdout(Stdio::null())
            .stderr(stderr);
        if self.die_with_parent {
            die_with_parent(&mut cmd);
        }
        let child = cmd.spawn().map_err(|source| Error::Spawn {
            program: self.binary,
            source,
        })?;
        let addr = ([127, 0, 0, 1], port).into();
        Ok(RouterProcess {
            child,
            api: Api::new(addr),
            port,
            log,
            config,
            _dir: dir,
        })
    }
}

impl RouterProcess {
    /// A router process to start with [`RouterBuilder::spawn`].
    pub fn builder() -> RouterBuilder {
        RouterBuilder {
            binary: crate::bins::lockrouter(),
            env: Vec::new(),
            die_with_parent: false,
            log: None,
        }
    }

    /// The binary serving `shards` on `port`, once it is ready.
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
        Self::builder()
            .spawn(toml, port)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Blocks until `/readyz` answers 200 (every shard reachable, its ring
    /// recorded), at most `within`.
    pub fn wait_ready(&self, within: Duration) -> Result<(), Error> {
        let ready = || loopback::get(self.port, "/readyz").is_ok_and(|r| r.status == 200);
        if poll_until(within, ready) {
            return Ok(());
        }
        Err(Error::NotReady {
            what: format!("the router on port {}", self.port),
            state: "ready",
            within,
            log: self.log_tail(),
        })
    }

    /// Replaces the config file at once (a rename), so a reload or the
    /// router's own poll never reads half of it.
    pub fn rewrite_config(&self, toml: &str) -> std::io::Result<()> {
        let tmp = self.config.with_extension("toml.new");
        std::fs::write(&tmp, toml)?;
        std::fs::rename(&tmp, &self.config)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its `/metrics`, as Prometheus text (blocking).
    pub fn metrics_text(&self) -> std::io::Result<String> {
        loopback::get(self.port, "/metrics").map(|r| r.body)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The end of its log, for failure messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
