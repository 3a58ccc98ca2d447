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
//!
//! A cluster built with [`tls`](EtcdBuilder::tls) serves its clients over
//! `https://` with certificates of a CA of its own, made when it starts
//! ([`EtcdTls`]); [`client_cert_auth`](EtcdBuilder::client_cert_auth) also
//! requires client certificates. With [`auth`](EtcdBuilder::auth), etcd
//! auth is on and routers authenticate as a user of their own
//! ([`EtcdAuth`]). [`config`](crate::config) writes both into the router
//! configs it makes.

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
use crate::pki::Ca;
use crate::Error;

/// The key prefix the router user's role may read and write: the one the
/// kit's router configs use.
pub const ROUTER_PREFIX: &str = "/lockrouter";
/// The etcd user routers authenticate as on a cluster with auth.
pub const ROUTER_USER: &str = "lockrouter";
/// The common name of the client certificate [`EtcdTls`] makes: no etcd
/// user has it, so etcd auth never takes the certificate for a user.
pub const CLIENT_CERT_NAME: &str = "lockrouter-test-client";

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
    /// Where health and metrics are served over plain http, on a cluster
    /// with TLS (`--listen-metrics-urls`): the kit probes it there.
    metrics_port: Option<u16>,
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

    /// Where `/health` and `/metrics` answer over plain http.
    fn health_addr(&self) -> SocketAddr {
        let port = self.metrics_port.unwrap_or(self.client_port);
        SocketAddr::from((self.client_host, port))
    }
}

/// A cluster's TLS: PEM files in its dir, made when it starts.
pub struct EtcdTls {
    /// The CA that signed the members' and the client's certificates.
    pub ca: Ca,
    pub ca_file: PathBuf,
    /// A client certificate the CA signed (common name
    /// [`CLIENT_CERT_NAME`]), and its key.
    pub client_cert_file: PathBuf,
    pub client_key_file: PathBuf,
    /// Whether members require a client certificate the CA signed.
    pub client_cert_auth: bool,
    /// The members' certificate (127.0.0.1 and localhost) and key.
    server_cert_file: PathBuf,
    server_key_file: PathBuf,
}

impl EtcdTls {
    fn make(dir: &Path, client_cert_auth: bool) -> Result<Self, Error> {
        let dir = dir.join("tls");
        std::fs::create_dir_all(&dir).map_err(Error::prepare("etcd's TLS dir"))?;
        let ca = Ca::new("lockrouter test etcd CA");
        let server = ca.server(&["127.0.0.1", "localhost"]);
        let client = ca.client(CLIENT_CERT_NAME);
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(Error::prepare(format!("etcd's {name}")))?;
            Ok::<_, Error>(path)
        };
        Ok(Self {
            ca_file: write("ca.pem", &ca.pem)?,
            server_cert_file: write("server.pem", &server.cert_pem)?,
            server_key_file: write("server-key.pem", &server.key_pem)?,
            client_cert_file: write("client.pem", &client.cert_pem)?,
            client_key_file: write("client-key.pem", &client.key_pem)?,
            client_cert_auth,
            ca,
        })
    }

    /// The members' TLS flags.
    fn member_args(&self) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--cert-file".into(),
            self.server_cert_file.clone().into(),
            "--key-file".into(),
            self.server_key_file.clone().into(),
        ];
        if self.client_cert_auth {
            args.extend([
                "--client-cert-auth".into(),
                "--trusted-ca-file".into(),
                self.ca_file.clone().into(),
            ]);
        }
        args
    }

    /// etcd-client's TLS options: trusting the CA, presenting the client
    /// certificate.
    pub fn client_options(&self) -> etcd_client::TlsOptions {
        let read = |p: &Path| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(&self.ca.pem))
            .identity(etcd_client::Identity::from_pem(
                read(&self.client_cert_file),
                read(&self.client_key_file),
            ))
    }
}

/// etcd auth on a cluster: a root user, and [`ROUTER_USER`], whose role may
/// read and write the keys under [`ROUTER_PREFIX`] only.
pub struct EtcdAuth {
    pub user: String,
    pub password: String,
    /// A file holding `password` and a newline, for `shards[].password_file`.
    pub password_file: PathBuf,
    root_password: String,
}

pub struct EtcdCluster {
    /// Member `i` is named `m{i}`: tests address members by index.
    members: Vec<Member>,
    /// Extra flags for every member, after the kit's own.
    args: Vec<String>,
    /// Environment variables of every member (Go runtime settings).
    env: Vec<(String, String)>,
    /// The `--initial-cluster` value every member starts with.
    initial_cluster: String,
    /// Whether members are killed by the kernel if this process dies.
    die_with_parent: bool,
    /// Holds every member's dir; removed after they are killed.
    dir: TempDir,
    /// The namespaces the members run in; dropped after they are killed.
    _network: Option<Arc<Network>>,
    /// `Some`: clients speak TLS to the members.
    tls: Option<EtcdTls>,
    /// `Some`: etcd auth is on.
    auth: Option<EtcdAuth>,
    /// Keep the dir when dropped by a failing test.
    keep_on_failure: bool,
}

/// How a cluster is started: its size, extra flags, and whether its members
/// die with this process.
pub struct EtcdBuilder {
    /// How many members: 1 for a shard, 3 for a cluster that survives one
    /// member's loss.
    size: usize,
    /// See [`args`](Self::args).
    args: Vec<String>,
    /// See [`env`](Self::env).
    env: Vec<(String, String)>,
    /// See [`die_with_parent`](Self::die_with_parent).
    die_with_parent: bool,
    /// See [`in_network`](Self::in_network).
    network: Option<Arc<Network>>,
    /// See [`tls`](Self::tls): `Some(client_cert_auth)`.
    tls: Option<bool>,
    /// See [`auth`](Self::auth).
    auth: bool,
    /// See [`keep_on_failure`](Self::keep_on_failure).
    keep_on_failure: bool,
}

impl EtcdBuilder {
    /// Keeps the members' data dirs and logs when the cluster is dropped
    /// by a failing test (a panic), and prints where; as
    /// `LOCKROUTER_KEEP_ETCD_LOGS` does for every cluster.
    pub fn keep_on_failure(mut self) -> Self {
        self.keep_on_failure = true;
        self
    }

    /// Sets an environment variable of every member (etcd's Go runtime:
    /// `GOGC`, `GOMEMLIMIT`, `GOMAXPROCS`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

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

    /// Members serve their clients over TLS only (`https://`, with a
    /// certificate for 127.0.0.1 signed by a CA of the cluster's own; see
    /// [`EtcdCluster::tls`]); peers stay on plain http on loopback, and
    /// health and metrics move to a plain http listener of their own.
    /// Loopback clusters only.
    pub fn tls(mut self) -> Self {
        self.tls = Some(self.tls.unwrap_or(false));
        self
    }

    /// TLS, and members refuse clients without a certificate their CA
    /// signed (`--client-cert-auth`).
    pub fn client_cert_auth(mut self) -> Self {
        self.tls = Some(true);
        self
    }

    /// Turns etcd auth on once the members are up: a root user, and
    /// [`ROUTER_USER`] with readwrite on [`ROUTER_PREFIX`] (see
    /// [`EtcdCluster::auth`]). A token lapses after `--auth-token-ttl`
    /// seconds unused (300 unless [`args`](Self::args) say otherwise).
    pub fn auth(mut self) -> Self {
        self.auth = true;
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
        assert!(
            self.tls.is_none() || self.network.is_none(),
            "TLS clusters run on loopback only"
        );
        let tls = match self.tls {
            Some(client_cert_auth) => Some(EtcdTls::make(dir.path(), client_cert_auth)?),
            None => None,
        };
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
                            metrics_port: None,
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
                        metrics_port: match tls {
                            Some(_) => Some(try_free_port()?),
                            None => None,
                        },
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
        let auth = self.auth.then(|| EtcdAuth {
            user: ROUTER_USER.to_string(),
            password: "router-password".to_string(),
            password_file: dir.path().join("router-password"),
            root_password: "root-password".to_string(),
        });
        if let Some(a) = &auth {
            std::fs::write(&a.password_file, format!("{}\n", a.password))
                .map_err(Error::prepare("the router's password file"))?;
        }
        let mut cluster = EtcdCluster {
            members,
            args: self.args,
            env: self.env,
            initial_cluster,
            die_with_parent: self.die_with_parent,
            dir,
            _network: self.network,
            tls,
            auth,
            keep_on_failure: self.keep_on_failure,
        };
        cluster.start_all()?;
        cluster.enable_auth()?;
        Ok(cluster)
    }
}

/// The environment variable naming the etcd binary members run, so that
/// any test can run on another etcd release than the system's (`make
/// test-etcd35` runs the safety tests on etcd 3.5 this way).
pub const ETCD_BIN_VAR: &str = "LOCKROUTER_ETCD_BIN";

/// The etcd binary members run: [`ETCD_BIN_VAR`] when set, else
/// `/usr/bin/etcd` or `/usr/local/bin/etcd`. A set value that does not run
/// `--version` as etcd is an error, never a fall back to the system's etcd:
/// a run meant for one release must not pass on another.
pub fn etcd_binary() -> Result<PathBuf, Error> {
    Ok(etcd_release()?.0)
}

/// The etcd binary members run and the first line of its `--version`
/// (`etcd Version: X.Y.Z`), checked once per process. The first check
/// prints both, so a test's output says which release it ran on.
pub fn etcd_release() -> Result<(PathBuf, String), Error> {
    static RELEASE: std::sync::OnceLock<Result<(PathBuf, String), String>> =
        std::sync::OnceLock::new();
    let found = RELEASE.get_or_init(|| {
        let (binary, source) = match std::env::var_os(ETCD_BIN_VAR) {
            Some(v) => (PathBuf::from(v), ETCD_BIN_VAR),
            None => match ["/usr/bin/etcd", "/usr/local/bin/etcd"]
                .into_iter()
                .map(PathBuf::from)
                .find(|p| p.exists())
            {
                Some(p) => (p, "the system's etcd"),
                None => return Err(Error::EtcdMissing.to_string()),
            },
        };
        let version = Command::new(&binary)
            .arg("--version")
            .output()
            .map_err(|e| e.to_string())
            .and_then(|out| {
                let text = String::from_utf8_lossy(&out.stdout).to_string();
                let first = text.lines().next().unwrap_or("").to_string();
                if out.status.success() && first.starts_with("etcd Version: ") {
                    Ok(first)
                } else {
                    Err(format!(
                        "`--version` printed {:?}{}",
                        first,
                        String::from_utf8_lossy(&out.stderr)
                    ))
                }
            })
            .map_err(|why| {
                Error::EtcdUnusable {
                    binary: binary.clone(),
                    from: source,
                    why,
                }
                .to_string()
            })?;
        eprintln!("etcd: {} ({version}), from {source}", binary.display());
        Ok((binary, version))
    });
    found.clone().map_err(Error::EtcdRelease)
}

/// The etcdctl of the etcd members run: beside the binary named by
/// [`ETCD_BIN_VAR`] when it is set (a snapshot restored by another
/// release's etcdctl may write a data dir its etcd does not read), else
/// `/usr/bin/etcdctl` or `/usr/local/bin/etcdctl`.
fn etcdctl_binary() -> Result<PathBuf, Error> {
    if std::env::var_os(ETCD_BIN_VAR).is_some() {
        let etcd = etcd_binary()?;
        let beside = etcd.with_file_name("etcdctl");
        if beside.exists() {
            return Ok(beside);
        }
        return Err(Error::EtcdRelease(format!(
            "{ETCD_BIN_VAR} is {}, and no etcdctl is beside it (the snapshot tests need the etcdctl of the etcd they run)",
            etcd.display()
        )));
    }
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
            env: Vec::new(),
            die_with_parent: false,
            network: None,
            tls: None,
            auth: false,
            keep_on_failure: false,
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
        let client = self.client_url(i);
        let tls_args = self.tls.as_ref().map(EtcdTls::member_args);
        let m = &mut self.members[i];
        std::fs::create_dir_all(&m.dir).map_err(Error::prepare("etcd's data dir"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(m.log())
            .map_err(Error::prepare("etcd's log"))?;
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
            // As docs/operations.md asks of etcd 3.4 (3.5's default): a
            // member that comes back from a partition does not force an
            // election of its own with the term it inflated while away.
            .arg("--pre-vote")
            .args(tls_args.unwrap_or_default());
        if let Some(port) = m.metrics_port {
            let url = format!("http://{}:{port}", m.client_host);
            cmd.args(["--listen-metrics-urls", &url]);
        }
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
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
            loopback::request_at(m.health_addr(), "GET", "/health", PROBE_WITHIN)
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

    /// Client URLs of every member (`https://` with TLS).
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len())
            .map(|i| self.client_url(i))
            .collect()
    }

    fn client_url(&self, i: usize) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.members[i].client_addr())
    }

    /// The cluster's certificates, if it speaks TLS.
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.tls.as_ref()
    }

    /// The router's etcd user, if auth is on.
    pub fn auth(&self) -> Option<&EtcdAuth> {
        self.auth.as_ref()
    }

    /// Where member `i`'s data dir and log (`etcd.log`) are.
    pub fn member_dir(&self, i: usize) -> &Path {
        &self.members[i].dir
    }

    /// Member `i`'s log.
    pub fn log_text(&self, i: usize) -> String {
        std::fs::read_to_string(self.members[i].log()).unwrap_or_default()
    }

    /// etcd-client options reaching the members: TLS with the client
    /// certificate if the cluster has TLS; no user.
    fn options(&self) -> etcd_client::ConnectOptions {
        let options = etcd_client::ConnectOptions::new();
        match &self.tls {
            Some(tls) => options.with_tls(tls.client_options()),
            None => options,
        }
    }

    /// With [`auth`](EtcdBuilder::auth): creates the users and role, then
    /// enables auth (through etcd-client, on a thread of its own: a test's
    /// runtime may be running on this one).
    fn enable_auth(&self) -> Result<(), Error> {
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        let (endpoints, options) = (self.endpoints(), self.options());
        let setup = async move {
            use etcd_client::Permission;
            let mut c = etcd_client::Client::connect(endpoints, Some(options)).await?;
            c.user_add("root", auth.root_password.as_str(), None)
                .await?;
            c.user_grant_role("root", "root").await?;
            c.role_add(ROUTER_USER).await?;
            let perm = Permission::read_write(ROUTER_PREFIX).with_prefix();
            c.role_grant_permission(ROUTER_USER, perm).await?;
            c.user_add(auth.user.as_str(), auth.password.as_str(), None)
                .await?;
            c.user_grant_role(auth.user.as_str(), ROUTER_USER).await?;
            c.auth_enable().await?;
            Ok::<_, etcd_client::Error>(())
        };
        on_own_runtime(setup).map_err(|e| Error::Command {
            command: "enable etcd auth".into(),
            output: e.to_string(),
        })
    }

    /// The process id of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// Member `i`'s `/metrics`, as Prometheus text.
    pub fn metrics_text(&self, i: usize) -> std::io::Result<String> {
        let addr = self.members[i].health_addr();
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
    /// Returns once the kernel reports every thread of the member stopped:
    /// SIGSTOP is delivered thread by thread, and on busy cores a member
    /// can still answer a request sent just after `kill` returned.
    pub fn pause_member(&self, i: usize) {
        self.signal_member(i, Signal::SIGSTOP);
        let pid = self.pid(i).expect("member is running");
        let stopped = || crate::procfs::threads_stopped(pid);
        assert!(
            poll_until(Duration::from_secs(10), stopped),
            "etcd member {i} did not stop within 10 s of SIGSTOP"
        );
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
            let opts = self
                .options()
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
    /// same ports (a shard that lost its data, or a fresh replacement);
    /// with auth, the users are made again.
    pub fn wipe(&mut self) {
        self.kill();
        for m in &self.members {
            let _ = std::fs::remove_dir_all(m.dir.join("data"));
        }
        self.start_all().unwrap_or_else(|e| panic!("{e}"));
        self.enable_auth().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts every member again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.start_all().unwrap_or_else(|e| panic!("{e}"));
    }

    /// A client of the cluster: over TLS with the client certificate if
    /// it has TLS, as root if auth is on.
    pub async fn client(&self) -> etcd_client::Client {
        let options = match &self.auth {
            Some(a) => self.options().with_user("root", a.root_password.as_str()),
            None => self.options(),
        };
        etcd_client::Client::connect(self.endpoints(), Some(options))
            .await
            .unwrap()
    }

    /// A client of member `i` alone (as [`EtcdCluster::client`] otherwise):
    /// for calls only that member may answer, such as moving leadership
    /// off it.
    pub async fn member_client(&self, i: usize) -> etcd_client::Client {
        let options = match &self.auth {
            Some(a) => self.options().with_user("root", a.root_password.as_str()),
            None => self.options(),
        };
        etcd_client::Client::connect([&self.endpoints()[i]], Some(options))
            .await
            .unwrap()
    }
}

/// Runs `f` to completion on a runtime of its own, on a thread of its own.
fn on_own_runtime<F>(f: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime")
                    .block_on(f)
            })
            .join()
            .expect("the thread finishes")
    })
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill();
        let keep = self.keep_on_failure || std::env::var_os("LOCKROUTER_KEEP_ETCD_LOGS").is_some();
        if std::thread::panicking() && keep {
            let kept = self.dir.path().with_extension("kept");
            let _ = std::fs::rename(self.dir.path(), &kept);
            eprintln!("etcd data and logs kept in {}", kept.display());
        }
    }
}
