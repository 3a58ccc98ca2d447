//! Real etcd clusters for tests: each `EtcdCluster` owns its member
//! processes and their temp dirs, on free loopback ports; dropping it kills
//! and reaps them. Readiness is polled on `/health`; a member that does not
//! come up panics with its log.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

pub struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

pub struct EtcdCluster {
    members: Vec<Member>,
    /// Extra flags for every member.
    args: Vec<String>,
    initial_cluster: String,
    _dir: TempDir,
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn etcd_binary() -> PathBuf {
    for p in ["/usr/bin/etcd", "/usr/local/bin/etcd"] {
        if std::path::Path::new(p).exists() {
            return p.into();
        }
    }
    panic!("etcd is not installed: run `make test`, which installs etcd-server");
}

impl EtcdCluster {
    pub fn single() -> Self {
        Self::start(1)
    }

    pub fn start(size: usize) -> Self {
        Self::start_with(size, &[])
    }

    /// A cluster whose members also get `args` (later flags win).
    pub fn start_with(size: usize, args: &[&str]) -> Self {
        // tmpfs when there is one: fsync there is cheap, so tests run faster.
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        };
        let dir = tempfile::Builder::new()
            .prefix("lockrouter-etcd-")
            .tempdir_in(base)
            .unwrap();
        let members: Vec<Member> = (0..size)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                dir: dir.path().join(format!("m{i}")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self {
            members,
            args: args.iter().map(|a| a.to_string()).collect(),
            initial_cluster,
            _dir: dir,
        };
        for i in 0..size {
            cluster.spawn(i);
        }
        for i in 0..size {
            cluster.wait_healthy(i);
        }
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let m = &mut self.members[i];
        std::fs::create_dir_all(&m.dir).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(m.dir.join("etcd.log"))
            .unwrap();
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let child = Command::new(etcd_binary())
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(m.dir.join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-token", "lockrouter-test"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        m.child = Some(child);
    }

    fn wait_healthy(&self, i: usize) {
        let m = &self.members[i];
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if health_ok(m.client_port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(m.dir.join("etcd.log")).unwrap_or_default();
        panic!(
            "etcd member {} did not become healthy; its log:\n{log}",
            m.name
        );
    }

    /// Client URLs of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// Kills every member (SIGKILL), keeping the data.
    pub fn kill(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Stops one member with SIGSTOP (a process paused by GC, swap or a
    /// stalled disk): its connections stay open but nothing is answered.
    pub fn pause_member(&self, i: usize) {
        self.signal_member(i, nix::sys::signal::Signal::SIGSTOP);
    }

    /// Resumes a member stopped by [`pause_member`](Self::pause_member).
    pub fn resume_member(&self, i: usize) {
        self.signal_member(i, nix::sys::signal::Signal::SIGCONT);
    }

    fn signal_member(&self, i: usize, sig: nix::sys::signal::Signal) {
        let child = self.members[i].child.as_ref().expect("member is running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, sig).unwrap_or_else(|e| panic!("{sig} to member {i}: {e}"));
    }

    /// Index of the member that is leader now, as the members themselves
    /// report it (`None` while there is none or none answers).
    pub async fn leader(&self) -> Option<usize> {
        for (i, ep) in self.endpoints().iter().enumerate() {
            let opts = etcd_client::ConnectOptions::new()
                .with_connect_timeout(Duration::from_millis(300))
                .with_timeout(Duration::from_millis(500));
            let Ok(mut c) = etcd_client::Client::connect([ep], Some(opts)).await else {
                continue;
            };
            if let Ok(status) = c.status().await {
                let me = status.header().map(|h| h.member_id());
                if me == Some(status.leader()) {
                    return Some(i);
                }
            }
        }
        None
    }

    /// Kills one member (SIGKILL), keeping its data.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills every member and deletes its data, then starts it empty on the
    /// same ports (a shard that lost its data, or a fresh replacement).
    pub fn wipe(&mut self) {
        self.kill();
        for m in &self.members {
            let _ = std::fs::remove_dir_all(m.dir.join("data"));
        }
        for i in 0..self.members.len() {
            self.spawn(i);
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i);
        }
    }

    /// Starts every member again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        for i in 0..self.members.len() {
            self.spawn(i);
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i);
        }
    }

    /// One counter or gauge from the first member's `/metrics` (summed over
    /// label sets), 0 if absent.
    pub fn metric(&self, name: &str) -> f64 {
        let body = http_get(self.members[0].client_port, "/metrics").unwrap_or_default();
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect(self.endpoints(), None)
            .await
            .unwrap()
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() && std::env::var_os("LOCKROUTER_KEEP_ETCD_LOGS").is_some() {
            let kept = self._dir.path().with_extension("kept");
            let _ = std::fs::rename(self._dir.path(), &kept);
            eprintln!("etcd data and logs kept in {}", kept.display());
        }
    }
}

fn health_ok(port: u16) -> bool {
    http_get(port, "/health").is_some_and(|b| b.contains("\"health\":\"true\""))
}

/// A tiny blocking HTTP/1.0 GET, so the harness needs no runtime.
fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}
