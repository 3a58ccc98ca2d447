//! A [`Bench`]: the windows of one run on one stack, each between two
//! snapshots of every server's counters and after an idle check, turned
//! into [`Record`]s. What runs in which order is in [`run`](crate::run).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::attack::{self, Plan};
use crate::idle::{self, IdleCheck, Rest};
use crate::options::Config;
use crate::report::{self, Record};
use crate::scenarios::baselines::{self, EtcdBaseline, Kind};
use crate::scenarios::clients::Clients;
use crate::scenarios::lifecycle::{self, Lifecycle};
use crate::scenarios::warmup::{self, Warmup, WarmupOutcome, WARMUP_LIMIT};
use crate::scrape::Snapshot;
use crate::stack::Stack;
use crate::stats::Stats;

/// The scenarios the paired rounds are made of.
pub const PAIRED: [&str; 4] = ["direct", "naive", "uncontested", "latency"];

pub struct Bench<'a> {
    pub cfg: &'a Config,
    pub stack: &'a Stack,
    /// `shared` or `pinned`: how the stack's processes are placed on CPUs.
    pub table: &'static str,
    pub records: Vec<Record>,
    /// Reports written per scenario name, so later rounds get their own file.
    reports: std::collections::HashMap<String, usize>,
}

impl<'a> Bench<'a> {
    pub fn new(cfg: &'a Config, stack: &'a Stack, table: &'static str) -> Self {
        Self {
            cfg,
            stack,
            table,
            records: Vec::new(),
            reports: std::collections::HashMap::new(),
        }
    }

    /// Whether the paired rounds include `scenario`. The pinned table runs
    /// all of them when none was named.
    pub fn wants_paired(&self, scenario: &str) -> bool {
        let named = PAIRED.iter().any(|s| self.cfg.wants(s));
        self.cfg.wants(scenario) || (self.table == "pinned" && !named)
    }

    /// A goose attack on this bench's router; its HTML report is named
    /// after the scenario (and the table, and a number for later rounds).
    pub fn plan(
        &mut self,
        name: &str,
        users: usize,
        run_time_s: usize,
        throttle: Option<usize>,
    ) -> Plan {
        let stem = match self.table {
            "shared" => file_name(name),
            table => format!("{table}-{}", file_name(name)),
        };
        let n = self.reports.entry(stem.clone()).or_default();
        *n += 1;
        let file = match *n {
            1 => format!("{stem}.html"),
            n => format!("{stem}-{n}.html"),
        };
        Plan {
            host: self.stack.router.api.base.clone(),
            users,
            run_time_s,
            throttle,
            report: Some(self.cfg.out.join(file)),
        }
    }

    /// Revokes every lease first if `revoke`, then waits for etcd to stand
    /// still (see [`idle`]). Without `revoke` the router's warm sessions
    /// are kept for the next window, so the wait is cut at a quarter of the
    /// TTL: waiting longer would let them expire (their leases' revocations
    /// are what keeps etcd busy) and turn the window's acquires into
    /// session grants.
    pub async fn settle(&self, revoke: bool) -> Result<IdleCheck> {
        let mut limit = Duration::from_secs(self.cfg.idle_limit_s);
        if !revoke {
            limit = limit.min(Duration::from_millis(self.cfg.ttl_ms / 4));
        }
        let rest = Rest {
            revoke,
            interval: Duration::from_millis(self.cfg.idle_ms),
            limit,
        };
        idle::settle(self.stack, rest).await
    }

    /// Gives every client of `clients` its session lease on every shard.
    pub async fn warm_up(&mut self, clients: &Clients) -> Result<WarmupOutcome> {
        self.warm_up_with(clients, self.cfg.users).await
    }

    /// [`warm_up`](Self::warm_up) by at most `users` users at once (a router
    /// with a low bound on requests in flight would refuse more).
    pub async fn warm_up_with(&mut self, clients: &Clients, users: usize) -> Result<WarmupOutcome> {
        let shards = self.stack.shards.len();
        eprintln!("== warm-up: {} clients x {shards} shards", clients.count());
        let ctx = Arc::new(Warmup::new(
            clients.clone(),
            shards,
            self.cfg.ttl_ms,
            &tag("warm-up"),
        ));
        let users = users.clamp(1, clients.count());
        let mut plan = self.plan("warm-up", users, WARMUP_LIMIT.as_secs() as usize + 60, None);
        plan.report = None;
        let before = Snapshot::take(self.stack)?;
        let started = Instant::now();
        let attack = attack::run(&plan, vec![warmup::scenario(&ctx)]);
        tokio::pin!(attack);
        let mut stopping = false;
        let metrics = loop {
            tokio::select! {
                m = &mut attack => break m,
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    let done = ctx.finished() || started.elapsed() > WARMUP_LIMIT;
                    if done && !stopping {
                        stopping = true;
                        goose::trigger_killswitch("warm-up done");
                    }
                }
            }
        };
        metrics?;
        let delta = Snapshot::take(self.stack)?.since(&before);
        let outcome = WarmupOutcome {
            clients: clients.count(),
            covered: ctx.covered.load(std::sync::atomic::Ordering::Relaxed),
            acquires: Stats::get(&ctx.stats.acquired),
            errors: Stats::get(&ctx.stats.errors),
            seconds: report::round(started.elapsed().as_secs_f64(), 1),
            lease_grants: delta.etcd.lease_grants,
        };
        eprintln!(
            "   {} of {} clients on every shard after {} acquires in {} s; {} session grants",
            outcome.covered,
            outcome.clients,
            outcome.acquires,
            outcome.seconds,
            outcome.lease_grants
        );
        Ok(outcome)
    }

    /// Acquire-release lock lives for `clients`, as fast as `users` go or
    /// at `rate` acquires/s.
    pub async fn lifecycle(
        &mut self,
        name: &str,
        users: usize,
        secs: usize,
        rate: Option<usize>,
        clients: &Clients,
    ) -> Result<Record> {
        eprintln!(
            "== {name}: {users} users, {} clients, {secs} s{}",
            clients.count(),
            rate.map(|r| format!(", {r} acquires/s"))
                .unwrap_or_default()
        );
        let ctx = Arc::new(Lifecycle::new(
            Stats::new(),
            self.cfg.ttl_ms,
            Duration::ZERO,
            &tag(name),
            clients.clone(),
        ));
        // Acquire and release are a request each.
        let plan = self.plan(name, users, secs, rate.map(|r| 2 * r));
        let before = Snapshot::take(self.stack)?;
        let metrics = attack::run(&plan, vec![lifecycle::scenario(name, &ctx)]).await?;
        let delta = Snapshot::take(self.stack)?.since(&before);
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.table = self.table.to_string();
        r.users = users;
        r.throttle_rps = plan.throttle;
        r.clients = clients.count();
        r.goose_failures_total = attack::goose_failures(&metrics);
        report_line(&r);
        Ok(r)
    }

    /// The `direct` or `naive` baseline, straight to etcd.
    pub async fn baseline(
        &mut self,
        name: &str,
        kind: Kind,
        rate: Option<usize>,
    ) -> Result<Record> {
        let users = self.cfg.users;
        let secs = self.cfg.duration_s;
        eprintln!("== {name}: {users} users, {secs} s, straight to etcd");
        let ttl_secs = (self.cfg.ttl_ms / 1000).max(2) as i64;
        let ctx = Arc::new(
            EtcdBaseline::connect(
                &self.stack.endpoints(),
                kind,
                ttl_secs,
                &tag(name),
                Stats::new(),
            )
            .await?,
        );
        // A lock life is two requests; a barrier one.
        let requests = if kind == Kind::Barrier { 1 } else { 2 };
        let plan = self.plan(name, users, secs, rate.map(|r| requests * r));
        let before = Snapshot::take(self.stack)?;
        let metrics = attack::run(&plan, vec![baselines::scenario(name, &ctx)]).await;
        let delta = Snapshot::take(self.stack)?.since(&before);
        ctx.finish().await;
        let metrics = metrics?;
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.table = self.table.to_string();
        r.users = users;
        r.throttle_rps = plan.throttle;
        r.goose_failures_total = attack::goose_failures(&metrics);
        report_line(&r);
        Ok(r)
    }

    pub fn push(&mut self, r: Record) {
        report_line(&r);
        self.records.push(r);
    }
}

/// One line per record on stderr, to follow a run.
fn report_line(r: &Record) {
    eprintln!(
        "   {:.0} acquires/s, p50 {:.2} ms, p99 {:.2} ms{}, {} errors, {} 5xx{}, {:.3} raft writes/acquire, {:.4} grants/acquire, {:.2} keepalives/acquire, {:.0} keepalives/s, cores loadgen {:.2} router {:.2} etcd {:.2} machine {:.2}{}",
        r.acquires_per_s, r.acquire_p50_ms, r.acquire_p99_ms, router_p99s(r), r.errors_total, r.server_errors_total,
        r.server_error_causes(), r.etcd_proposals_per_acquire, r.etcd_lease_grants_per_acquire, r.etcd_keepalives_per_acquire,
        r.etcd_keepalives_per_s, r.cores.loadgen, r.cores.router, r.cores.etcd, r.cores.machine,
        r.server_error_messages()
    );
}

/// The router's own p99s of the window, as " (in the router 9.4 ms, its
/// etcd txns 5.3 ms)", or nothing when it served no acquire.
fn router_p99s(r: &Record) -> String {
    match (r.router_acquire_p99_ms, r.router_etcd_txn_p99_ms) {
        (Some(acquire), Some(txn)) => {
            format!(" (in the router {acquire:.1} ms, its etcd txns {txn:.1} ms)")
        }
        (Some(acquire), None) => format!(" (in the router {acquire:.1} ms)"),
        _ => String::new(),
    }
}

/// A name prefix unique to this scenario run, so no two runs share locks.
pub fn tag(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000_000)
        .unwrap_or(0);
    format!("{}-{nanos}", file_name(name))
}

fn file_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}
