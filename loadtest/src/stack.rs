//! The processes a benchmark runs against: single-node etcd clusters, one
//! per shard, and the `lockrouter` binary, started with lockrouter-testkit
//! on free loopback ports with their data on tmpfs when there is one (the
//! benchmark measures CPU cost, not the disk this machine happens to have;
//! see docs/benchmarks.md). Every process is killed and reaped when the
//! [`Stack`] drops, and by the kernel if this process is killed outright, so
//! a failed or interrupted run leaves nothing behind. The router may serve
//! only some of the shards, and its config file can be rewritten to list
//! all of them and reloaded (`rebalance`). A stack can also be started with
//! etcd on a CPU of its own ([`Stack::start_pinned`]). A scenario that
//! needs other router settings (`overload`: a bound on requests in flight,
//! read only at start) replaces the router with one started on them
//! ([`Stack::replace_router`]).

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use lockrouter_testkit::config::shards_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router_process::RouterProcess;

use crate::pinning::{self, Placement, Restore, Split};

/// Flags for every etcd shard, after the kit's test timings.
const ETCD_FLAGS: &[&str] = &[
    // etcd's own raft timings, not the kit's shorter ones for tests: the
    // benchmark measures what a deployment runs.
    "--heartbeat-interval",
    "100",
    "--election-timeout",
    "1000",
    // A million lock keys and their history must fit: 8 GiB quota instead
    // of the 2 GiB default (the data lives in memory anyway).
    "--quota-backend-bytes",
    "8589934592",
    // The compaction docs/capacity.md assumes (the planner's default
    // `--compaction-retention-secs 300`): history is kept five minutes.
    "--auto-compaction-mode",
    "periodic",
    "--auto-compaction-retention",
    "5m",
];

/// etcd's Go runtime settings unless `--etcd-go-env` says otherwise: the
/// heap may grow to five times what is live (GC is most of a leader's CPU
/// under renewals), within 4 GiB per shard (docs/capacity.md, "etcd's Go
/// runtime"; the deploy files set the same). `GOMAXPROCS` comes on top,
/// from [`etcd_procs`].
pub const ETCD_GO_ENV: &[(&str, &str)] = &[("GOGC", "400"), ("GOMEMLIMIT", "4GiB")];

/// `GOMAXPROCS` of each etcd when `--etcd-go-env` is not given: the cores
/// this run may use, shared out over the etcd processes it starts (shards
/// times members), at least one. Go's default is every core, so three
/// single-member shards on two cores would run six schedulers; with one
/// each, etcd switched threads less often and spent about a tenth less CPU
/// per lock life (docs/benchmarks.md, "etcd's threads on shared cores").
pub fn etcd_procs(cores: usize, processes: usize) -> usize {
    (cores / processes.max(1)).max(1)
}

/// The settings every etcd of this run starts with, set once at start.
static GO_ENV: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// Reads `--etcd-go-env` (empty: [`ETCD_GO_ENV`] and `GOMAXPROCS=procs`;
/// `none`: no settings) and
/// keeps it for every etcd this run starts, with `ETCD_ENABLE_PPROF=true`
/// added when `pprof` (etcd then serves Go's profiles on its client URL).
/// Each argument may hold several settings separated by white space
/// (`"GOGC=400 GOMEMLIMIT=4GiB"`); a value never does, so such an argument
/// is never taken as one setting with a value Go would ignore.
pub fn etcd_go_env(given: &[String], pprof: bool, procs: usize) -> Result<Vec<(String, String)>> {
    let pairs: Vec<&str> = given.iter().flat_map(|a| a.split_whitespace()).collect();
    let mut env: Vec<(String, String)> = match pairs[..] {
        [] => ETCD_GO_ENV
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .chain([("GOMAXPROCS".to_string(), procs.to_string())])
            .collect(),
        ["none"] => Vec::new(),
        _ => pairs
            .iter()
            .map(|p| match p.split_once('=') {
                Some((k, v)) if k.starts_with("GO") && !v.is_empty() && !v.contains('=') => {
                    Ok((k.to_string(), v.to_string()))
                }
                _ => Err(anyhow::anyhow!(
                    "--etcd-go-env {p:?}: expected Go runtime settings as KEY=VALUE (GOGC=400), or none"
                )),
            })
            .collect::<Result<_>>()?,
    };
    if pprof {
        env.push(("ETCD_ENABLE_PPROF".into(), "true".into()));
    }
    let _ = GO_ENV.set(env.clone());
    Ok(env)
}

/// The router's `server.worker_threads` for every router this run starts.
static WORKER_THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Keeps `--router-worker-threads` (0: one per core) for every router this
/// run starts.
pub fn router_worker_threads(n: usize) -> usize {
    let _ = WORKER_THREADS.set(n);
    n
}

/// Members of every etcd shard this run starts (`--etcd-members`).
static MEMBERS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Keeps `--etcd-members` for every shard this run starts: 1, 3 or 5.
pub fn etcd_members(n: usize) -> Result<usize> {
    if ![1, 3, 5].contains(&n) {
        anyhow::bail!("--etcd-members {n}: a shard runs 1, 3 or 5 members");
    }
    let _ = MEMBERS.set(n);
    Ok(n)
}

/// The processes of every member of `shard`.
pub fn member_pids(shard: &EtcdCluster) -> impl Iterator<Item = u32> + '_ {
    (0..shard.endpoints().len()).filter_map(|i| shard.pid(i))
}

/// `--router-etcd` lines for every router this run starts.
static ROUTER_ETCD: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Keeps `--router-etcd` (KEY=VALUE, VALUE in TOML) for every router this
/// run starts.
pub fn router_etcd(settings: &[String]) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for s in settings {
        let Some((key, value)) = s.split_once('=') else {
            anyhow::bail!("--router-etcd {s:?}: expected KEY=VALUE");
        };
        // A value the router cannot read stops it at start, with its message.
        lines.push(format!("{} = {}", key.trim(), value.trim()));
    }
    let _ = ROUTER_ETCD.set(lines.clone());
    Ok(lines)
}

/// How long the router may take to reach every shard and record its ring.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// The shards and the router of one benchmark run.
pub struct Stack {
    /// Declared first, so it stops before the shards it talks to.
    pub router: RouterProcess,
    /// Named a, b, c, ... in the router's config.
    pub shards: Vec<EtcdCluster>,
    /// The CPUs each process may use, as the kernel reports them.
    pub placement: Placement,
    /// The router's `server.max_in_flight` (None: the router's default),
    /// kept so that a rewritten config keeps it.
    pub max_in_flight: Option<usize>,
    /// A pinned stack's split, which a replaced router keeps.
    split: Option<Split>,
    /// For a pinned stack: puts the load generator back on every CPU once
    /// the processes are gone (declared last, so it drops last).
    _restore: Option<Restore>,
}

impl Stack {
    /// `shards` single-node etcd clusters named a, b, c, ... and a router.
    pub fn start(router_bin: &Path, shards: usize) -> Result<Self> {
        Self::start_partial(router_bin, shards, shards)
    }

    /// `shards` etcd clusters, and a router whose config lists only the
    /// first `routed` of them.
    pub fn start_partial(router_bin: &Path, shards: usize, routed: usize) -> Result<Self> {
        let shards = start_shards(shards)?;
        let router = start_router(router_bin, &shards[..routed.min(shards.len())], None)?;
        Ok(Self::assemble(router, shards, None))
    }

    /// Like [`start`](Self::start), with every etcd process on `split.etcd`,
    /// the router on `split.router` and this load generator on
    /// `split.loadgen`, until the stack drops. Call it from the main
    /// thread: the children inherit the CPUs of the thread that starts them
    /// (and are moved if they did not).
    pub fn start_pinned(router_bin: &Path, shards: usize, split: &Split) -> Result<Self> {
        let me = std::process::id();
        // From here on, whatever fails puts this process back.
        let restore = Restore {
            cpus: split.all.clone(),
        };
        pinning::pin(me, &split.etcd, false)?;
        let shards = start_shards(shards)?;
        let router = start_router_on(router_bin, &shards, None, split)?;
        for pid in shards.iter().flat_map(member_pids) {
            pinning::ensure(pid, &split.etcd)?;
        }
        let mut stack = Self::assemble(router, shards, Some(restore));
        stack.split = Some(split.clone());
        Ok(stack)
    }

    fn assemble(router: RouterProcess, shards: Vec<EtcdCluster>, restore: Option<Restore>) -> Self {
        let etcd: Vec<String> = shards.iter().map(|s| cpus(s.pid(0))).collect();
        let mut distinct = etcd.clone();
        distinct.dedup();
        let placement = Placement {
            etcd: distinct.join(" / "),
            router: cpus(Some(router.pid())),
            loadgen: cpus(Some(std::process::id())),
        };
        Self {
            router,
            shards,
            placement,
            max_in_flight: None,
            split: None,
            _restore: restore,
        }
    }

    /// Stops the router and starts another on the same shards (and a new
    /// port) with `server.max_in_flight` set to `max_in_flight` (None: the
    /// router's default). Call it from the main thread, as `start`.
    pub fn replace_router(
        &mut self,
        router_bin: &Path,
        max_in_flight: Option<usize>,
    ) -> Result<()> {
        let routed = &self.shards[..];
        // The old router is killed and reaped as it drops.
        self.router = match &self.split {
            Some(split) => start_router_on(router_bin, routed, max_in_flight, split)?,
            None => start_router(router_bin, routed, max_in_flight)?,
        };
        self.max_in_flight = max_in_flight;
        self.placement.router = cpus(Some(self.router.pid()));
        Ok(())
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.shards
            .iter()
            .flat_map(EtcdCluster::endpoints)
            .collect()
    }

    /// Rewrites the router's config to list every shard (it takes effect
    /// on reload).
    pub fn route_all_shards(&self) -> Result<()> {
        let toml = config_toml(self.router.port, &self.shards, self.max_in_flight);
        Ok(self.router.rewrite_config(&toml)?)
    }
}

/// `n` etcd clusters of `--etcd-members` members (1 by default), each
/// started from this thread.
fn start_shards(n: usize) -> Result<Vec<EtcdCluster>> {
    let shards = (0..n)
        .map(|_| {
            let members = MEMBERS.get().copied().unwrap_or(1);
            let mut builder = EtcdCluster::builder(members)
                .args(ETCD_FLAGS)
                .die_with_parent();
            for (k, v) in GO_ENV.get().into_iter().flatten() {
                builder = builder.env(k, v);
            }
            builder.start()
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(shards)
}

/// The CPUs a process may use, as the kernel reports them.
fn cpus(pid: Option<u32>) -> String {
    pid.and_then(pinning::cpus_allowed)
        .unwrap_or_else(|| "?".into())
}

/// A router over `shards`, ready.
fn start_router(
    router_bin: &Path,
    shards: &[EtcdCluster],
    max_in_flight: Option<usize>,
) -> Result<RouterProcess> {
    let port = free_port();
    let router = RouterProcess::builder()
        .binary(router_bin)
        .env("RUST_LOG", "warn")
        .die_with_parent()
        .spawn(&config_toml(port, shards, max_in_flight), port)?;
    router.wait_ready(READY_WITHIN)?;
    Ok(router)
}

/// A router started on `split.router`, this process (every thread) back
/// on `split.loadgen` afterwards.
fn start_router_on(
    router_bin: &Path,
    shards: &[EtcdCluster],
    max_in_flight: Option<usize>,
    split: &Split,
) -> Result<RouterProcess> {
    let me = std::process::id();
    pinning::pin(me, &split.router, false)?;
    let router = start_router(router_bin, shards, max_in_flight);
    pinning::pin(me, &split.loadgen, true)?;
    let router = router?;
    pinning::ensure(router.pid(), &split.router)?;
    Ok(router)
}

/// The router's config: its port, its bound on requests in flight if one
/// is given, and `shards`. The file is not polled for changes: only
/// `POST /admin/v1/reload` reloads it, so a benchmark knows the moment a
/// reload starts.
fn config_toml(port: u16, shards: &[EtcdCluster], max_in_flight: Option<usize>) -> String {
    let bound = max_in_flight.map_or(String::new(), |n| format!("max_in_flight = {n}\n"));
    let workers = WORKER_THREADS.get().copied().unwrap_or(0);
    let etcd: String = ROUTER_ETCD.get().map_or(String::new(), |l| {
        l.iter().map(|line| format!("{line}\n")).collect()
    });
    let header = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nworker_threads = {workers}\n{bound}\n[etcd]\nprefix = \"/lockrouter\"\n{etcd}\n[admin]\nreload_poll_ms = 0\n"
    );
    header + &shards_toml(&shards.iter().collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(env: &[(String, String)]) -> Vec<(&str, &str)> {
        env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    #[test]
    fn settings_in_one_argument_are_each_their_own() {
        let env = etcd_go_env(&["GOGC=400 GOMEMLIMIT=4GiB".into()], false, 1).unwrap();
        assert_eq!(pairs(&env), [("GOGC", "400"), ("GOMEMLIMIT", "4GiB")]);
        let env = etcd_go_env(&["GOGC=200".into(), "GOMAXPROCS=1".into()], true, 2).unwrap();
        assert_eq!(
            pairs(&env),
            [
                ("GOGC", "200"),
                ("GOMAXPROCS", "1"),
                ("ETCD_ENABLE_PPROF", "true")
            ]
        );
    }

    #[test]
    fn defaults_none_and_nonsense() {
        let env = etcd_go_env(&[], false, 3).unwrap();
        assert_eq!(
            pairs(&env),
            [("GOGC", "400"), ("GOMEMLIMIT", "4GiB"), ("GOMAXPROCS", "3")]
        );
        assert!(etcd_go_env(&["none".into()], false, 1).unwrap().is_empty());
        for bad in ["GOGC", "GOGC=", "PATH=/x", "GOGC=400=1"] {
            assert!(etcd_go_env(&[bad.into()], false, 1).is_err(), "{bad}");
        }
    }

    #[test]
    fn etcd_gets_its_share_of_the_cores() {
        assert_eq!(etcd_procs(2, 3), 1, "three shards on two cores");
        assert_eq!(etcd_procs(2, 9), 1, "never below one");
        assert_eq!(
            etcd_procs(2, 1),
            2,
            "one shard: every core, as Go's default"
        );
        assert_eq!(etcd_procs(8, 3), 2);
        assert_eq!(etcd_procs(4, 0), 4);
    }
}
