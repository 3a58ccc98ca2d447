//! Command line and sizes. A profile (`smoke` for CI, `full` for the
//! benchmark report) sets every size; any flag overrides its value.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// Small and quick: every scenario and baseline in about a minute.
    Smoke,
    /// As large as a 2-core machine allows in about half an hour.
    Full,
}

/// Every scenario, in the order a run executes them. `direct`, `naive`,
/// `uncontested` and `latency` run as paired rounds; `pinned` runs those
/// rounds again, last, with etcd on a core of its own.
pub const SCENARIOS: &[&str] = &[
    "direct",
    "naive",
    "barrier",
    "uncontested",
    "latency",
    "contended",
    "contended-wait",
    "churn",
    "hold",
    "per-lock-renew",
    "naive-hold",
    "rebalance",
    "overload",
    "overload-pinned",
    "pinned",
];

#[derive(Debug, Parser)]
#[command(
    name = "lockrouter-loadtest",
    about = "Load tests lockrouter against local etcd shards it starts itself, beside direct-to-etcd and naive baselines"
)]
pub struct Cli {
    #[arg(long, value_enum, default_value = "full")]
    pub profile: Profile,
    /// Comma-separated scenarios to run (default: all; the smoke profile
    /// leaves out overload-pinned). Known: direct, naive, barrier,
    /// uncontested, latency, contended, contended-wait, churn, hold,
    /// per-lock-renew, naive-hold, rebalance, overload, overload-pinned,
    /// pinned.
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Vec<String>,
    /// Where summary.json, summary.md and goose's HTML reports go.
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
    /// The `lockrouter` binary (default: next to this one).
    #[arg(long)]
    pub router_bin: Option<PathBuf>,
    /// Exit non-zero on any request error, 5xx, or accounting that does not add up.
    #[arg(long)]
    pub check: bool,
    /// Run nothing: put the targets of these earlier runs' output
    /// directories side by side (each named by its etcd release) in
    /// `compare.md` under `--out`. Give two or more.
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<PathBuf>,
    /// Give up (and stop everything) after this many minutes in all.
    #[arg(long)]
    pub max_minutes: Option<u64>,
    #[arg(long)]
    pub shards: Option<usize>,
    /// Concurrent users of the throughput scenarios and baselines.
    #[arg(long)]
    pub users: Option<usize>,
    /// Seconds each round of a throughput scenario runs.
    #[arg(long)]
    pub duration_s: Option<usize>,
    /// Paired rounds of the throughput and latency comparisons: each round
    /// runs the router and the baselines back to back, and the report takes
    /// the median of the per-round ratios.
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Distinct clientIds of the acquire scenarios (uncontested, latency,
    /// contended, churn), used in turn.
    #[arg(long)]
    pub acquire_clients: Option<usize>,
    /// Idle check before each measured window: etcd counts as idle when its
    /// proposals and keepalives stand still for this many ms.
    #[arg(long)]
    pub idle_ms: Option<u64>,
    /// Acquires/s at which router and direct latency are compared.
    #[arg(long)]
    pub fixed_rate: Option<usize>,
    /// Lock TTL in ms for every scenario (hold renews every TTL/3).
    #[arg(long)]
    pub ttl_ms: Option<u64>,
    /// `hold`: active leases L.
    #[arg(long)]
    pub locks: Option<u64>,
    /// `hold`: clients C sharing them.
    #[arg(long)]
    pub clients: Option<usize>,
    /// `hold`: goose users simulating the clients.
    #[arg(long)]
    pub hold_users: Option<usize>,
    /// `hold`: seconds the steady hold window lasts.
    #[arg(long)]
    pub hold_s: Option<u64>,
    /// `hold`: give up ramping after this many seconds and hold what was reached.
    #[arg(long)]
    pub ramp_limit_s: Option<u64>,
    /// `churn`: target acquires/s A.
    #[arg(long)]
    pub churn_rate: Option<usize>,
    /// `churn`: seconds it runs, alone and again on top of `hold`.
    #[arg(long)]
    pub churn_s: Option<usize>,
    /// `per-lock-renew`: active leases and clients.
    #[arg(long)]
    pub per_lock_locks: Option<u64>,
    #[arg(long)]
    pub per_lock_clients: Option<usize>,
    /// `naive-hold`: leases held the naive way.
    #[arg(long)]
    pub naive_hold_leases: Option<u64>,
    /// `contended-wait`: seconds it runs.
    #[arg(long)]
    pub wait_s: Option<usize>,
    /// `rebalance`: churn acquires/s while the shard set changes.
    #[arg(long)]
    pub rebalance_rate: Option<usize>,
    /// `rebalance`: seconds of churn before the reload.
    #[arg(long)]
    pub rebalance_before_s: Option<u64>,
    /// `overload`: seconds of the overloaded window.
    #[arg(long)]
    pub overload_s: Option<u64>,
    /// `overload`: lock lives offered per second, as a multiple of the
    /// capacity measured just before.
    #[arg(long)]
    pub overload_factor: Option<f64>,
    /// `overload`: the router's `server.max_in_flight` (default: by Little's
    /// law, capacity in requests/s times the acquire p99 at capacity).
    #[arg(long)]
    pub overload_max_in_flight: Option<usize>,
    /// Go runtime settings of every etcd the suite starts, as KEY=VALUE
    /// (repeatable): `GOGC=400`, `GOMEMLIMIT=8GiB`, `GOMAXPROCS=1`; `none`
    /// for etcd's own defaults. Default: `ETCD_GO_ENV` in stack.rs, and
    /// `GOMAXPROCS` at etcd's share of the cores (`etcd_procs`).
    #[arg(long)]
    pub etcd_go_env: Vec<String>,
    /// etcd serves Go's pprof on its client URL (`/debug/pprof/`), for
    /// profiling a window with `go tool pprof`; the URLs are printed.
    #[arg(long)]
    pub etcd_pprof: bool,
    /// The router's `server.worker_threads` (default 0: one per core).
    #[arg(long)]
    pub router_worker_threads: Option<usize>,
    /// Settings of the router's `[etcd]` section, as KEY=VALUE in TOML
    /// (repeatable), for every router the suite starts:
    /// `keepalive_burst_ms=20`, `keepalive_below_pct=70`.
    #[arg(long)]
    pub router_etcd: Vec<String>,
    /// Members of every etcd shard (default 1; 3 or 5 as deployments run
    /// them). etcd's CPU is then all members' together, and so are its
    /// counters: what each member does for every entry (proposals, lease
    /// grants and revokes) counted once, what only the member a request
    /// reached handles (Txn RPCs, keepalives, renewed on the leader)
    /// summed.
    #[arg(long)]
    pub etcd_members: Option<usize>,
}

/// Resolved sizes of one run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Config {
    pub profile: String,
    pub scenarios: Vec<String>,
    pub out: PathBuf,
    pub router_bin: PathBuf,
    pub check: bool,
    pub max_minutes: u64,
    pub shards: usize,
    pub users: usize,
    pub duration_s: usize,
    /// Paired rounds of the throughput and latency comparisons.
    pub rounds: usize,
    pub acquire_clients: usize,
    pub idle_ms: u64,
    /// How long the idle check waits for etcd to stand still before it
    /// reports "not idle" and the window starts anyway.
    pub idle_limit_s: u64,
    pub fixed_rate: usize,
    pub ttl_ms: u64,
    pub locks: u64,
    pub clients: usize,
    pub hold_users: usize,
    pub hold_s: u64,
    pub ramp_limit_s: u64,
    pub settle_s: u64,
    pub churn_rate: usize,
    pub churn_s: usize,
    pub churn_users: usize,
    pub per_lock_locks: u64,
    pub per_lock_clients: usize,
    pub naive_hold_leases: u64,
    pub contended_users: usize,
    pub contended_names: usize,
    pub contended_hold_ms: u64,
    pub wait_s: usize,
    /// `waitMs` of every acquire in `contended-wait`.
    pub wait_ms: u64,
    pub rebalance_rate: usize,
    pub rebalance_users: usize,
    pub rebalance_before_s: u64,
    pub rebalance_after_s: u64,
    pub rebalance_close_limit_s: u64,
    /// `overload`: the overloaded window, offered load over capacity, and
    /// the bound on requests in flight if given (else derived).
    pub overload_s: u64,
    pub overload_factor: f64,
    pub overload_max_in_flight: Option<usize>,
    /// The Go runtime settings every etcd runs with.
    pub etcd_go_env: Vec<(String, String)>,
    /// The router's `server.worker_threads` (0: one per core).
    pub router_worker_threads: usize,
    /// `--router-etcd` settings, one TOML line each.
    pub router_etcd: Vec<String>,
    /// Members of every etcd shard.
    pub etcd_members: usize,
    /// `overload`: clientIds of its lock lives (warm pool).
    pub overload_clients: usize,
    /// `overload`: clients holding locks through it, locks each, and their
    /// TTL (they renew every TTL/3 with one renew-batch).
    pub overload_holders: usize,
    pub overload_locks_per_holder: usize,
    pub overload_ttl_ms: u64,
}

impl Cli {
    pub fn config(self) -> anyhow::Result<Config> {
        let smoke = self.profile == Profile::Smoke;
        let shards = self.shards.unwrap_or(3);
        let etcd_members = crate::stack::etcd_members(self.etcd_members.unwrap_or(1))?;
        anyhow::ensure!(
            self.overload_factor.is_none_or(|f| f > 0.0 && f <= 20.0),
            "--overload-factor must be above 0 and at most 20"
        );
        anyhow::ensure!(
            self.overload_max_in_flight
                .is_none_or(|n| (5..=1_000_000).contains(&n)),
            "--overload-max-in-flight must be 5 to 1000000 (the router's own range)"
        );
        let scenarios = if self.scenarios.is_empty() {
            // The smoke run checks that every scenario works; the pinned
            // overload is `overload` again on other CPUs, and CI's time
            // is better spent elsewhere.
            SCENARIOS
                .iter()
                .filter(|s| !(smoke && **s == "overload-pinned"))
                .map(|s| s.to_string())
                .collect()
        } else {
            for s in &self.scenarios {
                anyhow::ensure!(
                    SCENARIOS.contains(&s.as_str()),
                    "unknown scenario {s:?}; known: {}",
                    SCENARIOS.join(", ")
                );
            }
            self.scenarios
        };
        let router_bin = self
            .router_bin
            .unwrap_or_else(lockrouter_testkit::bins::lockrouter);
        anyhow::ensure!(
            router_bin.exists(),
            "{} does not exist; build it or pass --router-bin",
            router_bin.display()
        );
        Ok(Config {
            profile: format!("{:?}", self.profile).to_lowercase(),
            scenarios,
            out: self.out,
            router_bin,
            check: self.check,
            max_minutes: self.max_minutes.unwrap_or(pick(smoke, 10, 90)),
            shards,
            users: self.users.unwrap_or(pick(smoke, 8, 64)),
            duration_s: self.duration_s.unwrap_or(pick(smoke, 4, 10)),
            rounds: self.rounds.unwrap_or(pick(smoke, 1, 5)).max(1),
            acquire_clients: self
                .acquire_clients
                .unwrap_or(pick(smoke, 100, 10_000))
                .max(1),
            idle_ms: self.idle_ms.unwrap_or(pick(smoke, 300, 1_000)),
            idle_limit_s: pick(smoke, 10, 60),
            fixed_rate: self.fixed_rate.unwrap_or(pick(smoke, 100, 1000)),
            ttl_ms: self.ttl_ms.unwrap_or(pick(smoke, 6_000, 30_000)),
            locks: self.locks.unwrap_or(pick(smoke, 2_000, 1_000_000)),
            clients: self.clients.unwrap_or(pick(smoke, 20, 10_000)),
            hold_users: self.hold_users.unwrap_or(pick(smoke, 10, 200)),
            hold_s: self.hold_s.unwrap_or(pick(smoke, 4, 30)),
            ramp_limit_s: self.ramp_limit_s.unwrap_or(pick(smoke, 120, 660)),
            settle_s: pick(smoke, 1, 3),
            churn_rate: self.churn_rate.unwrap_or(pick(smoke, 200, 10_000)),
            churn_s: self.churn_s.unwrap_or(pick(smoke, 4, 30)),
            churn_users: pick(smoke, 8, 64),
            per_lock_locks: self.per_lock_locks.unwrap_or(pick(smoke, 200, 20_000)),
            per_lock_clients: self.per_lock_clients.unwrap_or(pick(smoke, 10, 200)),
            naive_hold_leases: self.naive_hold_leases.unwrap_or(pick(smoke, 200, 20_000)),
            contended_users: pick(smoke, 8, 32),
            contended_names: 4,
            contended_hold_ms: 2,
            wait_s: self.wait_s.unwrap_or(pick(smoke, 4, 10)),
            wait_ms: 5_000,
            rebalance_rate: self.rebalance_rate.unwrap_or(pick(smoke, 200, 1_000)),
            rebalance_users: pick(smoke, 8, 32),
            rebalance_before_s: self.rebalance_before_s.unwrap_or(pick(smoke, 6, 10)),
            rebalance_after_s: pick(smoke, 3, 5),
            rebalance_close_limit_s: pick(smoke, 60, 120),
            overload_s: self.overload_s.unwrap_or(pick(smoke, 5, 20)).max(1),
            overload_factor: self.overload_factor.unwrap_or(2.0),
            overload_max_in_flight: self.overload_max_in_flight,
            etcd_go_env: crate::stack::etcd_go_env(
                &self.etcd_go_env,
                self.etcd_pprof,
                crate::stack::etcd_procs(
                    std::thread::available_parallelism().map_or(1, |n| n.get()),
                    shards * etcd_members,
                ),
            )?,
            router_worker_threads: crate::stack::router_worker_threads(
                self.router_worker_threads.unwrap_or(0),
            ),
            router_etcd: crate::stack::router_etcd(&self.router_etcd)?,
            etcd_members,
            overload_clients: pick(smoke, 100, 1_000),
            overload_holders: pick(smoke, 10, 50),
            overload_locks_per_holder: pick(smoke, 10, 100),
            overload_ttl_ms: 3_000,
        })
    }
}

/// The smoke or the full size of a setting.
fn pick<T>(smoke: bool, smoke_value: T, full_value: T) -> T {
    if smoke {
        smoke_value
    } else {
        full_value
    }
}

impl Config {
    pub fn wants(&self, scenario: &str) -> bool {
        self.scenarios.iter().any(|s| s == scenario)
    }
}
