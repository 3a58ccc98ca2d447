//! The processes a benchmark runs against: single-node etcd clusters (one
//! per shard) and the `lockrouter` binary, each on free loopback ports with
//! its data in a temp dir. Every value owns its child process and kills and
//! reaps it on drop, so a failed or interrupted run leaves nothing behind.
//! The router may serve only some of the shards, and its config file can be
//! rewritten and reloaded (`rebalance`). Also reads a process's memory and
//! CPU time from `/proc`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tempfile::TempDir;

/// A loopback port nobody listens on right now.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One etcd process: a single-node cluster serving one shard.
pub struct EtcdShard {
    pub name: String,
    pub client_port: u16,
    child: Child,
    log: PathBuf,
}

impl EtcdShard {
    /// Starts etcd with its data under `dir` and waits until it is healthy.
    pub fn start(name: &str, dir: &Path) -> Result<Self> {
        let client_port = free_port()?;
        let peer_port = free_port()?;
        let data = dir.join(format!("etcd-{name}"));
        std::fs::create_dir_all(&data)?;
        let log = dir.join(format!("etcd-{name}.log"));
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let child = orphan_proof(Command::new(etcd_binary()?))
            .args(["--name", name])
            .arg("--data-dir")
            .arg(data.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("{name}={peer}")])
            // A million lock keys and their history must fit: 8 GiB quota
            // instead of the 2 GiB default (the data lives in memory anyway).
            .args(["--quota-backend-bytes", &(8u64 << 30).to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("start etcd")?;
        let shard = Self {
            name: name.to_string(),
            client_port,
            child,
            log,
        };
        shard.wait_healthy()?;
        Ok(shard)
    }

    fn wait_healthy(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if http_get(self.client_port, "/health")
                .is_ok_and(|b| b.contains("\"health\":\"true\""))
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "etcd shard {} did not become healthy; its log ends:\n{}",
            self.name,
            tail(&self.log)
        )
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn metrics_text(&self) -> Result<String> {
        http_get(self.client_port, "/metrics")
    }
}

impl Drop for EtcdShard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Makes the child die with this process even when this process is killed
/// outright (no destructor runs then): the kernel sends it SIGKILL.
fn orphan_proof(mut cmd: Command) -> Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    cmd
}

fn etcd_binary() -> Result<PathBuf> {
    for p in ["/usr/bin/etcd", "/usr/local/bin/etcd"] {
        if Path::new(p).exists() {
            return Ok(p.into());
        }
    }
    bail!("etcd is not installed (`make prereqs` installs Debian's etcd-server)")
}

/// The `lockrouter` binary serving the given shards.
pub struct RouterProcess {
    pub port: u16,
    child: Child,
    log: PathBuf,
    config: PathBuf,
}

impl RouterProcess {
    pub fn start(binary: &Path, shards: &[EtcdShard], dir: &Path) -> Result<Self> {
        let port = free_port()?;
        let config = dir.join("router.toml");
        std::fs::write(&config, Self::config_toml(port, shards))?;
        let log = dir.join("router.log");
        let child = orphan_proof(Command::new(binary))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let router = Self {
            port,
            child,
            log,
            config,
        };
        router.wait_ready()?;
        Ok(router)
    }

    /// The router's config: its port and `shards`. The file is not polled
    /// for changes: only `POST /admin/v1/reload` reloads it, so a benchmark
    /// knows the moment a reload starts.
    fn config_toml(port: u16, shards: &[EtcdShard]) -> String {
        let mut toml = format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n\n[etcd]\nprefix = \"/lockrouter\"\n\n[admin]\nreload_poll_ms = 0\n"
        );
        for s in shards {
            toml.push_str(&format!(
                "\n[[shards]]\nname = \"{}\"\nendpoints = [\"{}\"]\n",
                s.name,
                s.endpoint()
            ));
        }
        toml
    }

    /// Rewrites the config file to list `shards` (takes effect on reload).
    pub fn rewrite_config(&self, shards: &[EtcdShard]) -> Result<()> {
        let tmp = self.config.with_extension("toml.new");
        std::fs::write(&tmp, Self::config_toml(self.port, shards))?;
        std::fs::rename(&tmp, &self.config)?;
        Ok(())
    }

    /// `POST /admin/v1/reload` to the router on `port` (loopback needs no
    /// token): status and body. Blocking, as every call here.
    pub fn reload_port(port: u16) -> Result<(u16, String)> {
        let raw = http_request(port, "POST", "/admin/v1/reload")?;
        Ok((status_of(&raw)?, body_of(&raw)))
    }

    /// `GET /admin/v1/ring` of the router on `port`, as JSON.
    pub fn ring_port(port: u16) -> Result<serde_json::Value> {
        Ok(serde_json::from_str(&http_get(port, "/admin/v1/ring")?)?)
    }

    /// `/readyz` answers 200 once every shard is reachable and its ring is
    /// recorded (the router initialises fresh clusters by itself).
    fn wait_ready(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if http_status(self.port, "/readyz").is_ok_and(|s| s == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!(
            "the router did not become ready; its log ends:\n{}",
            tail(&self.log)
        )
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn metrics_text(&self) -> Result<String> {
        http_get(self.port, "/metrics")
    }

    pub fn log_tail(&self) -> String {
        tail(&self.log)
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shards and the router of one benchmark run, and the temp dir that
/// holds their data and logs (removed on drop, after the processes).
pub struct Stack {
    pub router: RouterProcess,
    pub shards: Vec<EtcdShard>,
    _dir: TempDir,
}

impl Stack {
    /// `shards` single-node etcd clusters named a, b, c, ... and a router.
    /// Data goes to tmpfs when there is one: the benchmark measures CPU cost,
    /// not the disk this machine happens to have (see docs/benchmarks.md).
    pub fn start(router_bin: &Path, shards: usize) -> Result<Self> {
        Self::start_partial(router_bin, shards, shards)
    }

    /// `shards` etcd clusters, and a router whose config lists only the
    /// first `routed` of them.
    pub fn start_partial(router_bin: &Path, shards: usize, routed: usize) -> Result<Self> {
        let base = if Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        };
        let dir = tempfile::Builder::new()
            .prefix("lockrouter-bench-")
            .tempdir_in(base)?;
        let shards = (0..shards)
            .map(|i| EtcdShard::start(&((b'a' + i as u8) as char).to_string(), dir.path()))
            .collect::<Result<Vec<_>>>()?;
        let router =
            RouterProcess::start(router_bin, &shards[..routed.min(shards.len())], dir.path())?;
        Ok(Self {
            router,
            shards,
            _dir: dir,
        })
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.shards.iter().map(EtcdShard::endpoint).collect()
    }
}

/// Resident set size of `pid` now, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:").map(|k| k * 1024)
}

/// Peak resident set size of `pid` since start or the last
/// [`reset_peak_rss`], in bytes.
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:").map(|k| k * 1024)
}

/// Resets the kernel's peak-RSS mark of `pid` (writing 5 to `clear_refs`),
/// so a phase's peak is its own. Fails quietly where not permitted; the
/// benchmark also samples RSS itself.
pub fn reset_peak_rss(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// CPU time (user + system, all threads) `pid` has used, in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces: utime and stime
    // are fields 14 and 15 of the whole line.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((utime + stime) / ticks.max(1.0))
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Status code of a blocking HTTP/1.0 GET on loopback.
fn http_status(port: u16, path: &str) -> Result<u16> {
    status_of(&http_raw(port, path)?)
}

fn status_of(raw: &str) -> Result<u16> {
    raw.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("malformed status line")
}

fn body_of(raw: &str) -> String {
    raw.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// Body of a blocking HTTP/1.0 GET on loopback: enough for `/health`,
/// `/readyz`, `/metrics` and the admin routes, and it needs no runtime.
pub fn http_get(port: u16, path: &str) -> Result<String> {
    Ok(body_of(&http_raw(port, path)?))
}

fn http_raw(port: u16, path: &str) -> Result<String> {
    http_request(port, "GET", path)
}

fn http_request(port: u16, method: &str, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}
