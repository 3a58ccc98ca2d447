//! Real etcd clusters: each `EtcdCluster` owns its member processes and
//! their temp dir (on tmpfs when there is one), on free loopback ports;
//! dropping it kills and reaps them. Readiness is polled on `/health`; a
//! member that does not come up is an [`Error`] carrying the end of its log.
//! Members can be paused, killed, wiped and restarted on the same ports, and
//! the cluster says which member leads.
//!
//! A cluster built [`in_network`](EtcdBuilder::in_network) runs each member
//! in a network namespace of a [`Network`], at its own address there, so
//! tests can cut links between members and routers.
//!
//! Members run with short raft timings (heartbeat 50 ms, election 500 ms) so
//! tests elect fast; extra flags come after them and win.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use crate::child::{die_with_parent, log_tail, poll_until};
use crate::loopback::{self, try_free_port};
use crate::netns::{self, Network};
use crate::Error;

/// How long a member may take to answer healthy after it starts.
const HEALTHY_WITHIN: Duration = Duration::from_secs(30);
/// How long one `/health` probe waits: probes are repeated, so a member
/// that accepts but does not answer must not hold one up.
const PROBE_WITHIN: Duration = Duration::from_secs(2);

struct Member {
    /// Its etcd member name: m0, m1, ...
    name: String,
    /// Where clients reach it: 127.0.0.1, or its address in its network
    /// namespace.
    client_host: Ipv4Addr,
    /// Fixed for the cluster's life, so a restarted member is where the
    /// others and the routers' configs expect it.
    client_port: u16,
    /// Where the other members reach it.
    peer_host: Ipv4Addr,
    /// Likewise fixed: the other members know it by this port.
    peer_port: u16,
    /// Its data dir and log, kept across kills until a wipe.
    dir: PathBuf,
    /// The network namespace it runs in, if any.
    netns: Option<String>,
    /// `None` while killed.
    child: Option<Child>,
}

impl Member {
    fn log(&self) -> PathBuf {
        self.dir.join("etcd.log")
    }

    fn client_addr(&self) -> SocketAddr {
        SocketAddr::from((self.client_host, self.client_port))
    }
}

pub struct EtcdCluster {
    /// Member `i` is named `m{i}`: tests address members by index.
    members: Vec<Member>,
    /// Extra flags for every member, after the kit's own.
    args: Vec<String>,
    /// The `--initial-cluster` value every member starts with.
    initial_cluster: String,
    /// Whether members are killed by the kernel if this process dies.
    die_with_parent: bool,
    /// Holds every member's dir; removed after they are killed.
    dir: TempDir,
    /// The namespaces the members run in; dropped after they are killed.
    _network: Option<Arc<Network>>,
}

/// How a cluster is started: its size, extra flags, and whether its members
/// die with this process.
pub struct EtcdBuilder {
    /// How many members: 1 for a shard, 3 for a cluster that survives one
    /// member's loss.
    size: usize,
    /// See [`args`](Self::args).
    args: Vec<String>,
    /// See [`die_with_parent`](Self::die_with_parent).
    die_with_parent: bool,
    /// See [`in_network`](Self::in_network).
    network: Option<Arc<Network>>,
}

impl EtcdBuilder {
    /// Adds flags for every member (e.g. `--quota-backend-bytes`); later
    /// flags win over the kit's and earlier ones.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Members are killed by the kernel if this process dies, even by
    /// SIGKILL; see [`child::die_with_parent`](crate::child::die_with_parent) for
    /// which thread must start them.
    pub fn die_with_parent(mut self) -> Self {
        self.die_with_parent = true;
        self
    }

    /// Runs member `i` in `network`'s namespace `i`, at its addresses
    /// there, so that the network's cuts apply to it. The network must
    /// have a namespace for every member.
    pub fn in_network(mut self, network: Arc<Network>) -> Self {
        self.network = Some(network);
        self
    }

    /// Starts every member and waits until each answers healthy.
    pub fn start(self) -> Result<EtcdCluster, Error> {
        // tmpfs when there is one: fsync there is cheap, so tests run faster.
        let base = if Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        };
        let dir = tempfile::Builder::new()
            .prefix("lockrouter-etcd-")
            .tempdir_in(base)
            .map_err(Error::prepare("etcd's temp dir"))?;
        let members = (0..self.size)
            .map(|i| {
                let dir = dir.path().join(format!("m{i}"));
                let name = format!("m{i}");
                Ok(match &self.network {
                    Some(net) => {
                        assert!(i < net.size(), "the network has no namespace {i}");
                        Member {
                            name,
                            client_host: net.client_addr(i),
                            client_port: netns::CLIENT_PORT,
                            peer_host: net.peer_addr(i),
                            peer_port: netns::PEER_PORT,
                            dir,
                            netns: Some(net.member(i)),
                            child: None,
                        }
                    }
                    None => Member {
                        name,
                        client_host: Ipv4Addr::LOCALHOST,
                        client_port: try_free_port()?,
                        peer_host: Ipv4Addr::LOCALHOST,
                        peer_port: try_free_port()?,
                        dir,
                        netns: None,
                        child: None,
                    },
                })
            })
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(Error::prepare("etcd's ports"))?;
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://{}:{}", m.name, m.peer_host, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            members,
            args: self.args,
            initial_cluster,
            die_with_parent: self.die_with_parent,
            dir,
            _network: self.network,
        };
        cluster.start_all()?;
        Ok(cluster)
    }
}

fn etcd_binary() -> Result<PathBuf, Error> {
    ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or(Error::EtcdMissing)
}

fn etcdctl_binary() -> Result<PathBuf, Error> {
    ["/usr/bin/etcdctl", "/usr/local/bin/etcdctl"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or(Error::EtcdctlMissing)
}

/// Runs etcdctl (API v3) with `args`; its output is the error.
fn etcdctl(args: &[&std::ffi::OsStr]) -> Result<(), Error> {
    let binary = etcdctl_binary()?;
    let out = Command::new(&binary)
        .env("ETCDCTL_API", "3")
        .args(args)
        .output()
        .map_err(|source| Error::Spawn {
            program: binary.clone(),
            source,
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Command {
        command: format!(
            "etcdctl {}",
            args.iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    })
}

impl EtcdCluster {
    /// A cluster of `size` members, to start with [`EtcdBuilder::start`].
    pub fn builder(size: usize) -> EtcdBuilder {
        EtcdBuilder {
            size,
            args: Vec::new(),
            die_with_parent: false,
            network: None,
        }
    }

    pub fn single() -> Self {
        Self::start(1)
    }

    pub fn start(size: usize) -> Self {
        Self::start_with(size, &[])
    }

    /// A cluster whose members also get `args` (later flags win).
    pub fn start_with(size: usize, args: &[&str]) -> Self {
        Self::builder(size)
            .args(args)
            .start()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts every member that is not running, then waits for each.
    fn start_all(&mut self) -> Result<(), Error> {
        for i in 0..self.members.len() {
            self.spawn(i)?;
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i)?;
        }
        Ok(())
    }

    fn spawn(&mut self, i: usize) -> Result<(), Error> {
        let binary = etcd_binary()?;
        let m = &mut self.members[i];
        std::fs::create_dir_all(&m.dir).map_err(Error::prepare("etcd's data dir"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(m.log())
            .map_err(Error::prepare("etcd's log"))?;
        let client = format!("http://{}", m.client_addr());
        let peer = format!("http://{}:{}", m.peer_host, m.peer_port);
        // `ip netns exec` enters the namespace and execs etcd: the child's
        // pid is etcd's, for signals and kills.
        let mut cmd = match &m.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&binary);
                c
            }
            None => Command::new(&binary),
        };
        cmd.args(["--name", &m.name])
            .arg("--data-dir")
            .arg(m.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-token", "lockrouter-test"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(log);
        if self.die_with_parent {
            die_with_parent(&mut cmd);
        }
        let child = cmd.spawn().map_err(|source| Error::Spawn {
            program: binary,
            source,
        })?;
        m.child = Some(child);
        Ok(())
    }

    fn wait_healthy(&self, i: usize) -> Result<(), Error> {
        let m = &self.members[i];
        let healthy = || {
            loopback::request_at(m.client_addr(), "GET", "/health", PROBE_WITHIN)
                .is_ok_and(|r| r.body.contains("\"health\":\"true\""))
        };
        if poll_until(HEALTHY_WITHIN, healthy) {
            return Ok(());
        }
        Err(Error::NotReady {
            what: format!("etcd member {}", m.name),
            state: "healthy",
            within: HEALTHY_WITHIN,
            log: log_tail(&m.log()),
        })
    }

    /// Client URLs of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://{}", m.client_addr()))
            .collect()
    }

    /// The process id of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// Member `i`'s `/metrics`, as Prometheus text.
    pub fn metrics_text(&self, i: usize) -> std::io::Result<String> {
        let addr = self.members[i].client_addr();
        loopback::request_at(addr, "GET", "/metrics", loopback::ANSWER_WITHIN).map(|r| r.body)
    }

    /// One counter or gauge from the first member's `/metrics` (summed over
    /// label sets), 0 if absent.
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text(0).unwrap_or_default();
        crate::metrics::sum(&text, name, &[])
    }

    /// Kills every member (SIGKILL), keeping the data.
    pub fn kill(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
    }

    /// Kills one member (SIGKILL), keeping its data.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts member `i` again (after [`kill_member`](Self::kill_member))
    /// on its ports and data, and waits until it is healthy (blocking).
    pub fn restart_member(&mut self, i: usize) {
        if self.members[i].child.is_none() {
            self.spawn(i).unwrap_or_else(|e| panic!("{e}"));
        }
        self.wait_healthy(i).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Stops one member with SIGSTOP (a process paused by GC, swap or a
    /// stalled disk): its connections stay open but nothing is answered.
    pub fn pause_member(&self, i: usize) {
        self.signal_member(i, Signal::SIGSTOP);
    }

    /// Resumes a member stopped by [`pause_member`](Self::pause_member).
    pub fn resume_member(&self, i: usize) {
        self.signal_member(i, Signal::SIGCONT);
    }

    fn signal_member(&self, i: usize, sig: Signal) {
        let pid = self.pid(i).expect("member is running");
        let pid = nix::unistd::Pid::from_raw(pid as i32);
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

    /// Saves a snapshot of the cluster's data to `path`, as an operator's
    /// backup does (`etcdctl snapshot save`, from member 0).
    pub fn snapshot(&self, path: &Path) {
        let endpoint = &self.endpoints()[0];
        etcdctl(&[
            "--endpoints".as_ref(),
            endpoint.as_ref(),
            "snapshot".as_ref(),
            "save".as_ref(),
            path.as_os_str(),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Kills every member and restores each from `snapshot` into a new
    /// data dir (`etcdctl snapshot restore`) as a cluster with the token
    /// `token`, then starts them on the same addresses. etcd derives the
    /// cluster id from the token and the peer URLs: a new token gives a new
    /// id, as the restore runbook in docs/operations.md asks.
    pub fn restore(&mut self, snapshot: &Path, token: &str) {
        self.kill();
        for m in &self.members {
            let data = m.dir.join("data");
            let _ = std::fs::remove_dir_all(&data);
            let peer = format!("http://{}:{}", m.peer_host, m.peer_port);
            etcdctl(&[
                "snapshot".as_ref(),
                "restore".as_ref(),
                snapshot.as_os_str(),
                "--name".as_ref(),
                m.name.as_ref(),
                "--data-dir".as_ref(),
                data.as_os_str(),
                "--initial-cluster".as_ref(),
                self.initial_cluster.as_ref(),
                "--initial-cluster-token".as_ref(),
                token.as_ref(),
                "--initial-advertise-peer-urls".as_ref(),
                peer.as_ref(),
            ])
            .unwrap_or_else(|e| panic!("{e}"));
        }
        self.start_all().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Kills every member and deletes its data, then starts it empty on the
    /// same ports (a shard that lost its data, or a fresh replacement).
    pub fn wipe(&mut self) {
        self.kill();
        for m in &self.members {
            let _ = std::fs::remove_dir_all(m.dir.join("data"));
        }
        self.start_all().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts every member again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.start_all().unwrap_or_else(|e| panic!("{e}"));
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
            let kept = self.dir.path().with_extension("kept");
            let _ = std::fs::rename(self.dir.path(), &kept);
            eprintln!("etcd data and logs kept in {}", kept.display());
        }
    }
}
