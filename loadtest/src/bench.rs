//! One benchmark run: start the shards and the router, run each selected
//! scenario between two snapshots of every server's counters, turn what was
//! counted into [`Record`]s, and write the summary. Scenarios run one after
//! another on the same processes, so their ratios compare like with like.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use serde_json::{json, Value};

use crate::attack::{self, Plan};
use crate::options::Config;
use crate::report::{self, Record};
use crate::scenarios::baselines::{self, EtcdBaseline, Kind};
use crate::scenarios::contended::{self, Contended};
use crate::scenarios::contended_wait::{self, ContendedWait};
use crate::scenarios::hold::{self, Controller, Hold, Phases, Renewal};
use crate::scenarios::lifecycle::{self, Lifecycle};
use crate::scenarios::rebalance::{self, Rebalance};
use crate::scrape::Snapshot;
use crate::stack::Stack;
use crate::stats::Stats;

pub struct Bench<'a> {
    cfg: &'a Config,
    stack: &'a Stack,
    records: Vec<Record>,
    /// Reports written per scenario name, so later rounds get their own file.
    reports: std::collections::HashMap<String, usize>,
}

impl<'a> Bench<'a> {
    pub fn new(cfg: &'a Config, stack: &'a Stack) -> Self {
        Self {
            cfg,
            stack,
            records: Vec::new(),
            reports: std::collections::HashMap::new(),
        }
    }

    pub async fn run(mut self) -> Result<Vec<Record>> {
        let c = self.cfg;
        let secs = c.duration_s;
        // Router and baselines take turns, round after round, so anything
        // else this machine does weighs on all of them alike; each keeps
        // its median round.
        let mut rounds: Vec<Vec<Record>> = Vec::new();
        for _ in 0..c.rounds {
            let mut round = Vec::new();
            if c.wants("direct") {
                round.push(self.baseline("direct", Kind::Direct, None).await?);
            }
            if c.wants("naive") {
                round.push(self.baseline("naive", Kind::Naive, None).await?);
            }
            if c.wants("uncontested") {
                round.push(
                    self.lifecycle("uncontested", c.users, secs, None, Duration::ZERO)
                        .await?,
                );
            }
            if c.wants("latency") {
                let rate = c.fixed_rate;
                let name = format!("uncontested@{rate}/s");
                round.push(
                    self.lifecycle(&name, c.users, secs, Some(rate), Duration::ZERO)
                        .await?,
                );
                let name = format!("direct@{rate}/s");
                round.push(self.baseline(&name, Kind::Direct, Some(rate)).await?);
            }
            rounds.push(round);
        }
        for i in 0..rounds.first().map_or(0, Vec::len) {
            let all: Vec<Record> = rounds.iter().map(|r| r[i].clone()).collect();
            let m = median(all);
            eprintln!("== {}: median of {} rounds", m.scenario, c.rounds);
            self.records.push(m);
        }
        if c.wants("contended") {
            self.contended().await?;
        }
        if c.wants("contended-wait") {
            self.contended_wait().await?;
        }
        if c.wants("churn") {
            let r = self
                .lifecycle(
                    "churn",
                    c.churn_users,
                    c.churn_s,
                    Some(c.churn_rate),
                    Duration::ZERO,
                )
                .await?;
            self.records.push(r);
        }
        if c.wants("hold") {
            self.hold(
                "hold",
                Renewal::Batch,
                c.locks,
                c.clients,
                c.hold_users,
                true,
            )
            .await?;
        }
        if c.wants("per-lock-renew") {
            let users = c.hold_users.min(c.per_lock_clients);
            self.hold(
                "per-lock-renew",
                Renewal::PerLock,
                c.per_lock_locks,
                c.per_lock_clients,
                users,
                false,
            )
            .await?;
        }
        if c.wants("naive-hold") {
            self.naive_hold().await?;
        }
        if c.wants("rebalance") {
            self.rebalance().await?;
        }
        self.fill_baselines();
        Ok(self.records)
    }

    fn plan(
        &mut self,
        name: &str,
        users: usize,
        run_time_s: usize,
        throttle: Option<usize>,
    ) -> Plan {
        let n = self.reports.entry(name.to_string()).or_default();
        *n += 1;
        let file = match *n {
            1 => format!("{}.html", file_name(name)),
            n => format!("{}-{n}.html", file_name(name)),
        };
        Plan {
            host: self.stack.router.api.base.clone(),
            users,
            run_time_s,
            throttle,
            report: self.cfg.out.join(file),
        }
    }

    /// Users' expected interval between acquires at `rate` acquires/s.
    fn interval(users: usize, rate: Option<usize>) -> Option<Duration> {
        rate.map(|r| Duration::from_secs_f64(users as f64 / r.max(1) as f64))
    }

    async fn lifecycle(
        &mut self,
        name: &str,
        users: usize,
        secs: usize,
        rate: Option<usize>,
        hold: Duration,
    ) -> Result<Record> {
        eprintln!(
            "== {name}: {users} users, {secs} s{}",
            rate.map(|r| format!(", {r} acquires/s"))
                .unwrap_or_default()
        );
        let stats = Stats::new(Self::interval(users, rate));
        let ctx = Arc::new(Lifecycle::new(stats, self.cfg.ttl_ms, hold, &tag(name)));
        // Acquire and release are a request each.
        let plan = self.plan(name, users, secs, rate.map(|r| 2 * r));
        let before = Snapshot::take(self.stack)?;
        let metrics = attack::run(&plan, vec![lifecycle::scenario(name, &ctx)]).await?;
        let delta = Snapshot::take(self.stack)?.since(&before);
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.users = users;
        r.throttle_rps = plan.throttle;
        r.clients = users;
        r.goose_failures_total = attack::goose_failures(&metrics);
        report_line(&r);
        Ok(r)
    }

    async fn baseline(&mut self, name: &str, kind: Kind, rate: Option<usize>) -> Result<Record> {
        let users = self.cfg.users;
        let secs = self.cfg.duration_s;
        eprintln!("== {name}: {users} users, {secs} s, straight to etcd");
        let stats = Stats::new(Self::interval(users, rate));
        let ttl_secs = (self.cfg.ttl_ms / 1000).max(2) as i64;
        let ctx = Arc::new(
            EtcdBaseline::connect(&self.stack.endpoints(), kind, ttl_secs, &tag(name), stats)
                .await?,
        );
        let plan = self.plan(name, users, secs, rate.map(|r| 2 * r));
        let before = Snapshot::take(self.stack)?;
        let metrics = attack::run(&plan, vec![baselines::scenario(name, &ctx)]).await;
        let delta = Snapshot::take(self.stack)?.since(&before);
        ctx.finish().await;
        let metrics = metrics?;
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.users = users;
        r.throttle_rps = plan.throttle;
        r.goose_failures_total = attack::goose_failures(&metrics);
        report_line(&r);
        Ok(r)
    }

    async fn contended(&mut self) -> Result<()> {
        let c = self.cfg;
        let name = "contended";
        eprintln!(
            "== {name}: {} users on {} names, {} s",
            c.contended_users, c.contended_names, c.duration_s
        );
        let t = tag(name);
        let ctx = Arc::new(Contended {
            stats: Stats::new(None),
            ttl_ms: c.ttl_ms,
            names: (0..c.contended_names)
                .map(|i| format!("{t}:hot{i}"))
                .collect(),
            hold: Duration::from_millis(c.contended_hold_ms),
            tag: t,
        });
        let plan = self.plan(name, c.contended_users, c.duration_s, None);
        let before = Snapshot::take(self.stack)?;
        let metrics = attack::run(&plan, vec![contended::scenario(&ctx)]).await?;
        let delta = Snapshot::take(self.stack)?.since(&before);
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.users = c.contended_users;
        r.clients = c.contended_users;
        r.goose_failures_total = attack::goose_failures(&metrics);
        let (jain, min, max) = ctx.stats.fairness(c.contended_users);
        let attempts = r.acquires_total + r.not_acquired_total;
        r.detail = json!({
            "names": c.contended_names,
            "hold_ms": c.contended_hold_ms,
            "attempts_per_s": report::round(attempts as f64 / r.duration_s.max(1e-9), 1),
            "grant_ratio": report::round(r.acquires_total as f64 / attempts.max(1) as f64, 3),
            "fairness_jain": report::round(jain, 3),
            "grants_per_user_min": min,
            "grants_per_user_max": max,
        });
        self.push(r);
        Ok(())
    }

    async fn contended_wait(&mut self) -> Result<()> {
        let c = self.cfg;
        let name = "contended-wait";
        eprintln!(
            "== {name}: {} users on {} names, waitMs {}, {} s",
            c.contended_users, c.contended_names, c.wait_ms, c.wait_s
        );
        let t = tag(name);
        let ctx = Arc::new(ContendedWait::new(
            Stats::new(None),
            c.ttl_ms,
            c.wait_ms,
            (0..c.contended_names)
                .map(|i| format!("{t}:hot{i}"))
                .collect(),
            Duration::from_millis(c.contended_hold_ms),
            t,
        ));
        let plan = self.plan(name, c.contended_users, c.wait_s, None);
        let before = Snapshot::take(self.stack)?;
        let metrics = attack::run(&plan, vec![contended_wait::scenario(&ctx)]).await?;
        let delta = Snapshot::take(self.stack)?.since(&before);
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.users = c.contended_users;
        r.clients = c.contended_users;
        r.goose_failures_total = attack::goose_failures(&metrics);
        let h = ctx.handover.raw();
        let (jain, min, max) = ctx.stats.fairness(c.contended_users);
        r.detail = json!({
            "names": c.contended_names,
            "hold_ms": c.contended_hold_ms,
            "wait_ms": c.wait_ms,
            "waits_timed_out": r.not_acquired_total,
            "handover": h,
            "handover_p50_ms": h.p50_ms,
            "handover_p99_ms": h.p99_ms,
            "handover_target_p99_ms": 20.0,
            "grants_not_handovers": ctx.cold_grants.load(std::sync::atomic::Ordering::Relaxed),
            "fairness_jain": report::round(jain, 3),
            "grants_per_user_min": min,
            "grants_per_user_max": max,
        });
        eprintln!(
            "   handover p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms over {} handovers",
            h.p50_ms, h.p99_ms, h.max_ms, h.count
        );
        self.push(r);
        Ok(())
    }

    /// Runs on its own shards and router: the router starts with only the
    /// first shard in its config, and the run adds the others.
    async fn rebalance(&mut self) -> Result<()> {
        let c = self.cfg;
        let name = "rebalance";
        if c.shards < 2 {
            eprintln!("== {name}: skipped, it needs at least 2 shards");
            return Ok(());
        }
        let stack = Stack::start_partial(&c.router_bin, c.shards, 1)?;
        eprintln!(
            "== {name}: router on 1 of {} shards, {} users, {} acquires/s; reload to all after {} s",
            c.shards, c.rebalance_users, c.rebalance_rate, c.rebalance_before_s
        );
        let users = c.rebalance_users;
        let rate = c.rebalance_rate;
        let ctx = Arc::new(Rebalance::new(
            Stats::new(Self::interval(users, Some(rate))),
            c.ttl_ms,
            &tag(name),
        ));
        let phases = rebalance::Phases {
            before: Duration::from_secs(c.rebalance_before_s),
            close_limit: Duration::from_secs(c.rebalance_close_limit_s),
            after: Duration::from_secs(c.rebalance_after_s),
        };
        // An upper bound only: the controller ends the attack.
        let bound = c.rebalance_before_s + c.rebalance_close_limit_s + c.rebalance_after_s + 60;
        let mut plan = self.plan(name, users, bound as usize, Some(2 * rate));
        plan.host = stack.router.api.base.clone();
        let before = Snapshot::take(&stack)?;
        let (metrics, timeline) = tokio::join!(
            attack::run(&plan, vec![rebalance::scenario(&ctx)]),
            rebalance::control(&stack, &phases)
        );
        let delta = Snapshot::take(&stack)?.since(&before);
        let (metrics, timeline) = match (metrics, timeline) {
            (Ok(m), Ok(t)) => (m, t),
            (m, t) => {
                eprintln!("the router's log ends:\n{}", stack.router.log_tail());
                m?;
                t?;
                unreachable!("one of them failed");
            }
        };
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.users = users;
        r.clients = users;
        r.throttle_rps = plan.throttle;
        r.goose_failures_total = attack::goose_failures(&metrics);
        r.detail = rebalance::windows(&ctx, &timeline, Duration::from_secs(5));
        let d = &r.detail;
        eprintln!(
            "   reload {} ({} ms), fence {} ms, migration open {} ms; {} errors ({} 503), {} 5xx outside the fence; p99 before {} / fence {} / migration {} / after {} ms",
            d["reload_status"], d["reload_call_ms"], d["fence_window_ms"], d["migration_open_ms"],
            d["errors"], d["status_503"], d["server_errors_outside_fence"],
            d["before"]["ok_p99_ms"], d["fence"]["ok_p99_ms"],
            d["migration_after_fence"]["ok_p99_ms"], d["after_close"]["ok_p99_ms"]
        );
        self.push(r);
        Ok(())
    }

    async fn hold(
        &mut self,
        name: &str,
        renewal: Renewal,
        locks: u64,
        clients: usize,
        users: usize,
        with_churn: bool,
    ) -> Result<()> {
        let c = self.cfg;
        eprintln!(
            "== {name}: {locks} locks, {clients} clients, {users} users, TTL {} ms",
            c.ttl_ms
        );
        let ctx = Arc::new(Hold::new(
            Stats::new(None),
            c.ttl_ms,
            clients,
            users,
            renewal,
            &tag(name),
        ));
        let mut scenarios = vec![hold::scenario(name, &ctx)];
        let mut total_users = users;
        let gate = Arc::new(AtomicBool::new(false));
        let churn = with_churn && c.wants("churn");
        let mut churn_ctx = None;
        if churn {
            let stats = Stats::new(Self::interval(c.churn_users, Some(c.churn_rate)));
            let mut l = Lifecycle::new(stats, c.ttl_ms, Duration::ZERO, &tag("churn-on-hold"));
            l.gate = Some(gate.clone());
            let l = Arc::new(l);
            let held = scenarios.remove(0).set_weight(users)?;
            scenarios = vec![
                held,
                lifecycle::scenario("churn-on-hold", &l).set_weight(c.churn_users)?,
            ];
            total_users += c.churn_users;
            churn_ctx = Some(l);
        }
        let phases = Phases {
            locks,
            ramp_limit: Duration::from_secs(c.ramp_limit_s),
            settle: Duration::from_secs(c.settle_s),
            hold: Duration::from_secs(c.hold_s),
            churn: churn.then(|| (Duration::from_secs(c.churn_s as u64), gate.clone())),
        };
        // An upper bound only: the controller ends the attack.
        let bound =
            c.ramp_limit_s + 4 * c.settle_s + c.hold_s + c.churn_s as u64 + c.ttl_ms / 1000 + 120;
        let plan = self.plan(
            name,
            total_users,
            bound as usize,
            churn.then_some(2 * c.churn_rate),
        );
        let controller = Controller {
            ctx: ctx.clone(),
            stack: self.stack,
            phases,
        };
        let before = Snapshot::take(self.stack)?;
        let (metrics, outcome) = tokio::join!(attack::run(&plan, scenarios), controller.run());
        let delta = Snapshot::take(self.stack)?.since(&before);
        let (metrics, outcome) = (metrics?, outcome?);

        let w = &outcome.window;
        // Per-acquire costs over the ramp, where the acquires happened.
        let mut r = Record::new(name, &ctx.stats, &outcome.ramp, outcome.ramp_s);
        // Rates of renewal traffic are over the steady window only.
        r.duration_s = report::round(w.seconds, 2);
        r.etcd_keepalives_per_s = report::round(w.etcd.lease_renewals / w.seconds, 1);
        r.router_keepalives_sent_per_s = report::round(w.router.keepalives_sent / w.seconds, 1);
        r.router_lease_renewals_per_s = report::round(w.router.lease_renewals / w.seconds, 1);
        r.etcd_proposals_per_s = report::round(w.etcd.proposals / w.seconds, 1);
        r.cores = w.cores;
        r.users = users;
        r.clients = clients;
        r.router_rss_peak_bytes = Some(outcome.rss_peak_bytes);
        r.router_bytes_per_lock = outcome.bytes_per_lock.map(|b| report::round(b, 1));
        // Requests of the whole attack, to compare with what the users sent.
        r.router_requests_total = delta.router.requests;
        r.goose_failures_total = attack::goose_failures(&metrics);
        r.detail = serde_json::to_value(&outcome)?;
        if let Some(map) = r.detail.as_object_mut() {
            map.insert(
                "renew_lag_max_ms".into(),
                json!(Stats::get(&ctx.stats.renew_lag_max_ms)),
            );
            // The whole attack: ramp, hold, churn, and the leases running out.
            map.insert("attack".into(), serde_json::to_value(&delta)?);
            map.insert("ramp_acquire_p99_ms".into(), json!(r.acquire_p99_ms));
        }
        self.push(r);

        if let (Some(l), Some(cw)) = (churn_ctx, outcome.churn_window.as_ref()) {
            let mut cr = Record::new("churn-on-hold", &l.stats, cw, l.stats.seconds());
            cr.users = c.churn_users;
            cr.clients = c.churn_users;
            cr.throttle_rps = Some(2 * c.churn_rate);
            cr.detail = json!({"held_locks_underneath": outcome.locks_reached});
            self.push(cr);
        }
        Ok(())
    }

    async fn naive_hold(&mut self) -> Result<()> {
        let c = self.cfg;
        let ttl_secs = (c.ttl_ms / 1000).max(2) as i64;
        let window = Duration::from_secs(c.hold_s.max(2 * ttl_secs as u64 / 3));
        eprintln!(
            "== naive-hold: {} leases, one keepalive each every {} s",
            c.naive_hold_leases,
            ttl_secs as f64 / 3.0
        );
        let outcome =
            baselines::naive_hold(self.stack, c.naive_hold_leases, ttl_secs, window).await?;
        let stats = Stats::new(None);
        let mut r = Record::new(
            "naive-hold",
            &stats,
            &outcome.window,
            outcome.window.seconds,
        );
        r.acquires_total = outcome.leases;
        r.active_leases_peak = outcome.leases;
        r.clients = outcome.leases as usize;
        r.errors_total = outcome.errors;
        r.detail = serde_json::to_value(&outcome)?;
        self.push(r);
        Ok(())
    }

    fn push(&mut self, r: Record) {
        report_line(&r);
        self.records.push(r);
    }

    /// Every record carries the baselines' headline figures.
    fn fill_baselines(&mut self) {
        let get = |name: &str| self.records.iter().find(|r| r.scenario == name).cloned();
        let (direct, naive) = (get("direct"), get("naive"));
        for r in &mut self.records {
            r.direct_acquires_per_s = direct.as_ref().map(|d| d.acquires_per_s);
            r.naive_acquires_per_s = naive.as_ref().map(|n| n.acquires_per_s);
            r.naive_etcd_proposals_per_acquire =
                naive.as_ref().map(|n| n.etcd_proposals_per_acquire);
        }
    }
}

/// One line per record on stderr, to follow a run.
fn report_line(r: &Record) {
    eprintln!(
            "   {:.0} acquires/s, p50 {:.2} ms, p99 {:.2} ms, {} errors, {} 5xx, {:.2} proposals/acquire, {:.0} keepalives/s, cores loadgen {:.2} router {:.2} etcd {:.2} machine {:.2}",
            r.acquires_per_s, r.acquire_p50_ms, r.acquire_p99_ms, r.errors_total, r.server_errors_total,
            r.etcd_proposals_per_acquire, r.etcd_keepalives_per_s, r.cores.loadgen, r.cores.router, r.cores.etcd, r.cores.machine
        );
}

/// The round with the median rate (latency pairs: the median p99).
fn median(mut rounds: Vec<Record>) -> Record {
    let fixed_rate = rounds[0].throttle_rps.is_some();
    let key = |r: &Record| {
        if fixed_rate {
            r.acquire_p99_ms
        } else {
            r.acquires_per_s
        }
    };
    rounds.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let values: Vec<f64> = rounds.iter().map(key).collect();
    let mut m = rounds.swap_remove(rounds.len() / 2);
    m.detail = json!({ "rounds": values.len(), "round_values": values, "median_of": if fixed_rate { "acquire_p99_ms" } else { "acquires_per_s" } });
    m
}

/// A name prefix unique to this scenario run, so no two runs share locks.
fn tag(name: &str) -> String {
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

/// Runs the whole benchmark and writes its files; returns the problems
/// `--check` found (empty when it was not asked for).
pub async fn run_all(cfg: &Config) -> Result<Vec<String>> {
    std::fs::create_dir_all(&cfg.out)?;
    let stack = Stack::start(&cfg.router_bin, cfg.shards)?;
    eprintln!(
        "{} etcd shards and the router at {} are up",
        stack.shards.len(),
        stack.router.api.base
    );
    let outcome = Bench::new(cfg, &stack).run().await;
    let records = match outcome {
        Ok(x) => x,
        Err(e) => {
            eprintln!("the router's log ends:\n{}", stack.router.log_tail());
            return Err(e);
        }
    };
    let targets = report::targets(&records, cfg.shards, cfg.ttl_ms);
    let problems = if cfg.check {
        report::check(&records)
    } else {
        Vec::new()
    };
    let summary = json!({
        "machine": machine(),
        "config": cfg,
        "scenarios": records,
        "targets": targets,
        "check_problems": problems,
    });
    report::write(&cfg.out, &summary, &records, &targets)?;
    for t in &targets {
        eprintln!(
            "target {:<60} {:>10} {} {:<8} {}",
            t.name,
            t.measured,
            t.rule,
            t.limit,
            if t.met { "met" } else { "MISSED" }
        );
    }
    eprintln!("wrote {}", cfg.out.join("summary.json").display());
    Ok(problems)
}

/// What the numbers were measured on.
fn machine() -> Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let etcd = std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_default();
    json!({"cores": cores, "memory_gib": mem_kib / (1 << 20), "cpu": cpu, "etcd": etcd})
}
