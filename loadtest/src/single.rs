//! The scenarios that run once each, after the paired rounds, on the same
//! stack (`rebalance` and `overload` on stacks of their own): `barrier`,
//! `contended`, `contended-wait`, `churn`, `hold` (with `churn-on-hold`),
//! `per-lock-renew` and `naive-hold`. Each window follows an idle check;
//! the acquire scenarios' clients are warmed up first.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use serde_json::json;

use crate::attack;
use crate::bench::{tag, Bench};
use crate::idle::{self, IdleCheck, Rest};
use crate::pinning::Split;
use crate::report::{self, Record};
use crate::scenarios::baselines;
use crate::scenarios::clients::Clients;
use crate::scenarios::contended::{self, Contended};
use crate::scenarios::contended_wait::{self, ContendedWait};
use crate::scenarios::hold::{self, Controller, Hold, Phases, Renewal};
use crate::scenarios::lifecycle::{self, Lifecycle};
use crate::scenarios::overload::{self, Overload};
use crate::scenarios::rebalance::{self, Rebalance};
use crate::scenarios::warmup::WarmupOutcome;
use crate::scrape::Snapshot;
use crate::stack::Stack;
use crate::stats::Stats;

/// What the overloaded window left for its record.
struct Overloaded {
    ctx: Arc<Overload>,
    outcome: overload::Outcome,
    /// Goose users: the arrivals' pool and the holders.
    users: usize,
    goose_failures: u64,
    idle: IdleCheck,
    warm: WarmupOutcome,
}

/// Barriers per second per shard in the `barrier` windows: 50 (the most one
/// router replica wrote when barriers were 20 ms apart; 20 now, at the
/// default `etcd.barrier_spacing_ms`), then four times that; the
/// difference gives what one more barrier costs, apart from what etcd
/// spends when idle.
const BARRIER_RATES_PER_SHARD: [usize; 2] = [50, 200];

impl Bench<'_> {
    /// `barrier`: the lock-key cache's barrier alone, straight to etcd, at
    /// two rates; what each costs etcd's CPU, on average and at the margin.
    pub async fn barrier(&mut self) -> Result<()> {
        let shards = self.stack.shards.len();
        let mut windows = Vec::new();
        for per_shard in BARRIER_RATES_PER_SHARD {
            let name = format!("barrier@{per_shard}/s/shard");
            let kind = crate::scenarios::baselines::Kind::Barrier;
            let r = self.baseline(&name, kind, Some(per_shard * shards)).await?;
            windows.push(r);
        }
        let per = |r: &Record| r.cpu_seconds.etcd / (r.acquires_total.max(1) as f64) * 1e6;
        let (low, high) = (&windows[0], &windows[1]);
        let more = high
            .acquires_total
            .saturating_sub(low.acquires_total)
            .max(1) as f64;
        let marginal = (high.cpu_seconds.etcd - low.cpu_seconds.etcd) / more * 1e6;
        let detail = json!({
            "etcd_cpu_us_per_barrier": [crate::stats::round(per(low), 1), crate::stats::round(per(high), 1)],
            "etcd_cpu_us_per_additional_barrier": crate::stats::round(marginal, 1),
        });
        eprintln!(
            "   etcd CPU per barrier {:.1} µs at the low rate, {:.1} µs at the high one, {marginal:.1} µs per additional barrier",
            per(low),
            per(high)
        );
        for mut r in windows {
            r.detail = detail.clone();
            self.push(r);
        }
        Ok(())
    }

    /// `contended`, for a warm pool of clients.
    pub async fn contended(&mut self) -> Result<()> {
        let c = self.cfg;
        let name = "contended";
        eprintln!(
            "== {name}: {} users on {} names, {} s",
            c.contended_users, c.contended_names, c.duration_s
        );
        let t = tag(name);
        let clients = Clients::new(&tag("pool"), c.acquire_clients);
        self.settle(true).await?;
        let warm = self.warm_up(&clients).await?;
        let idle = self.settle(false).await?;
        let ctx = Arc::new(Contended {
            stats: Stats::new(),
            ttl_ms: c.ttl_ms,
            names: (0..c.contended_names)
                .map(|i| format!("{t}:hot{i}"))
                .collect(),
            hold: Duration::from_millis(c.contended_hold_ms),
            clients: clients.clone(),
            seq: AtomicU64::new(0),
        });
        let plan = self.plan(name, c.contended_users, c.duration_s, None);
        let before = Snapshot::take(self.stack)?;
        let metrics = attack::run(&plan, vec![contended::scenario(&ctx)]).await?;
        let delta = Snapshot::take(self.stack)?.since(&before);
        let mut r = Record::new(name, &ctx.stats, &delta, ctx.stats.seconds());
        r.users = c.contended_users;
        r.clients = clients.count();
        (r.idle, r.warmup) = (Some(idle), Some(warm));
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

    /// `contended-wait`: one client per user, waiting in the queue.
    pub async fn contended_wait(&mut self) -> Result<()> {
        let c = self.cfg;
        let name = "contended-wait";
        eprintln!(
            "== {name}: {} users on {} names, waitMs {}, {} s",
            c.contended_users, c.contended_names, c.wait_ms, c.wait_s
        );
        let t = tag(name);
        let idle = self.settle(true).await?;
        let ctx = Arc::new(ContendedWait::new(
            Stats::new(),
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
        r.idle = Some(idle);
        r.goose_failures_total = attack::goose_failures(&metrics);
        let h = ctx.handover.percentiles();
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

    /// `churn` alone: lock lives at the target rate, for a warm pool.
    pub async fn churn(&mut self) -> Result<()> {
        let c = self.cfg;
        let clients = Clients::new(&tag("pool"), c.acquire_clients);
        self.settle(true).await?;
        let warm = self.warm_up(&clients).await?;
        let idle = self.settle(false).await?;
        let mut r = self
            .lifecycle(
                "churn",
                c.churn_users,
                c.churn_s,
                Some(c.churn_rate),
                &clients,
            )
            .await?;
        (r.idle, r.warmup) = (Some(idle), Some(warm));
        self.records.push(r);
        Ok(())
    }

    /// `hold`, renewing with `renew-batch`, with churn on top if selected.
    pub async fn hold_batch(&mut self) -> Result<()> {
        let c = self.cfg;
        self.hold(
            "hold",
            Renewal::Batch,
            c.locks,
            c.clients,
            c.hold_users,
            true,
        )
        .await
    }

    /// `per-lock-renew`: the same hold, smaller, one `renew` per lock.
    pub async fn per_lock_renew(&mut self) -> Result<()> {
        let c = self.cfg;
        let users = c.hold_users.min(c.per_lock_clients);
        self.hold(
            "per-lock-renew",
            Renewal::PerLock,
            c.per_lock_locks,
            c.per_lock_clients,
            users,
            false,
        )
        .await
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
        let idle = self.settle(true).await?;
        let ctx = Arc::new(Hold::new(
            Stats::new(),
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
            // The holding clients churn too: their sessions are alive.
            let mut l = Lifecycle::new(
                Stats::new(),
                c.ttl_ms,
                Duration::ZERO,
                &tag("churn-on-hold"),
                ctx.client_ids(),
            );
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
        r.idle = Some(idle);
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
            cr.clients = clients;
            cr.throttle_rps = Some(2 * c.churn_rate);
            cr.detail = json!({"held_locks_underneath": outcome.locks_reached});
            self.push(cr);
        }
        Ok(())
    }

    pub async fn naive_hold(&mut self) -> Result<()> {
        let c = self.cfg;
        let ttl_secs = (c.ttl_ms / 1000).max(2) as i64;
        let window = Duration::from_secs(c.hold_s.max(2 * ttl_secs as u64 / 3));
        eprintln!(
            "== naive-hold: {} leases, one keepalive each every {} s",
            c.naive_hold_leases,
            ttl_secs as f64 / 3.0
        );
        let idle = self.settle(true).await?;
        let outcome =
            baselines::naive_hold(self.stack, c.naive_hold_leases, ttl_secs, window).await?;
        let stats = Stats::new();
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
        r.idle = Some(idle);
        r.detail = serde_json::to_value(&outcome)?;
        self.push(r);
        Ok(())
    }

    /// Runs on its own shards and router: the router starts with only the
    /// first shard in its config, and the run adds the others.
    pub async fn rebalance(&mut self) -> Result<()> {
        let c = self.cfg;
        let name = "rebalance";
        if c.shards < 2 {
            eprintln!("== {name}: skipped, it needs at least 2 shards");
            return Ok(());
        }
        let stack = Stack::start_partial(&c.router_bin, c.shards, 1)?;
        let rest = Rest {
            revoke: false,
            interval: Duration::from_millis(c.idle_ms),
            limit: Duration::from_secs(c.idle_limit_s),
        };
        let idle = idle::settle(&stack, rest).await?;
        eprintln!(
            "== {name}: router on 1 of {} shards, {} users, {} acquires/s; reload to all after {} s",
            c.shards, c.rebalance_users, c.rebalance_rate, c.rebalance_before_s
        );
        let users = c.rebalance_users;
        let rate = c.rebalance_rate;
        let ctx = Arc::new(Rebalance::new(Stats::new(), c.ttl_ms, &tag(name)));
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
        r.idle = Some(idle);
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

    /// `overload`, on shards and a router of its own: the router's
    /// capacity and unloaded p99 first, then a router bounded by Little's
    /// law on them, offered a multiple of that capacity open-loop while
    /// holders renew.
    pub async fn overload(&mut self) -> Result<()> {
        let stack = Stack::start(&self.cfg.router_bin, self.cfg.shards)?;
        self.overload_on("overload", stack).await
    }

    /// `overload-pinned`: the same with the load generator on a CPU of its
    /// own and etcd and the router on the others, so that the latency of
    /// what the router admits is not the generator's wait for a core.
    /// Skipped, saying why, on a machine that cannot be split.
    pub async fn overload_pinned(&mut self) -> Result<()> {
        let split = match Split::loadgen_apart() {
            Ok(s) => s,
            Err(why) => {
                eprintln!("== overload-pinned: skipped: {why}");
                return Ok(());
            }
        };
        let stack = Stack::start_pinned(&self.cfg.router_bin, self.cfg.shards, &split)?;
        let p = &stack.placement;
        eprintln!(
            "== overload-pinned: CPUs: etcd {}, router {}, load generator {}",
            p.etcd, p.router, p.loadgen
        );
        self.overload_on("overload-pinned", stack).await
    }

    async fn overload_on(&mut self, name: &str, mut stack: Stack) -> Result<()> {
        let c = self.cfg;
        eprintln!(
            "== {name}: capacity, unloaded p99, then {}x capacity open-loop",
            c.overload_factor
        );
        let clients = Clients::new(&tag("pool"), c.overload_clients);
        let (capacity, unloaded) = {
            let mut b = Bench::new(c, &stack, self.table);
            let result = b.capacity(name, &clients).await;
            if result.is_err() {
                eprintln!("the router's log ends:\n{}", stack.router.log_tail());
            }
            result?
        };
        let lives = capacity.acquires_per_s;
        // Little's law: requests in flight = throughput x time in the
        // router. An acquire and a release per lock life, each taking what
        // an acquire's p99 was at capacity: the bound the router needs to
        // reach its capacity at all (group commit batches what is in
        // flight). Sized on the unloaded p99 instead (about half), it
        // held goodput to 0.4 of capacity in a run on this machine.
        let derived = (2.0 * lives * capacity.acquire_p99_ms / 1000.0).ceil() as usize;
        let bound = c.overload_max_in_flight.unwrap_or(derived.max(5));
        stack.replace_router(&c.router_bin, Some(bound))?;
        let rate = c.overload_factor * lives;
        // Outstanding requests the generator may have: what 100 ms of
        // arrivals need, and room for every slot of the bound twice.
        let workers = ((rate / 10.0).ceil() as usize)
            .max(4 * bound)
            .clamp(64, 2_000);
        eprintln!(
            "   capacity {lives:.0} lock lives/s, unloaded p99 {:.2} ms; max_in_flight {bound}; offering {rate:.0}/s from {workers} users",
            unloaded.acquire_p99_ms
        );
        let mut b = Bench::new(c, &stack, self.table);
        let result = b.overloaded(name, rate, workers, bound, &clients).await;
        if result.is_err() {
            eprintln!("the router's log ends:\n{}", stack.router.log_tail());
        }
        let Overloaded {
            ctx,
            outcome,
            users,
            goose_failures,
            idle,
            warm,
        } = result?;
        let w = &outcome.window;
        let mut r = Record::new(name, &ctx.stats, w, outcome.window_s);
        r.users = users;
        r.clients = clients.count();
        r.goose_failures_total = goose_failures;
        (r.idle, r.warmup) = (Some(idle), Some(warm));
        r.errors_total += Stats::get(&ctx.hold_stats.errors);
        r.server_errors_total += Stats::get(&ctx.hold_stats.server_errors);
        for (why, n) in ctx.hold_stats.server_errors_by() {
            *r.server_errors_by.entry(why).or_default() += n;
        }
        for (why, first) in ctx.hold_stats.server_error_first() {
            r.server_error_first.entry(why).or_insert(first);
        }
        let n = |x: &std::sync::atomic::AtomicU64| x.load(std::sync::atomic::Ordering::Relaxed);
        let k = &ctx.counts;
        r.renewed_total = n(&k.locks_renewed);
        r.lost_total = n(&k.locks_not_renewed) + n(&k.locks_lapsed);
        r.active_leases_peak = outcome.holder_locks;
        let goodput = Stats::get(&ctx.stats.released) as f64 / outcome.window_s;
        let due = n(&k.arrivals_due);
        r.detail = json!({
            "capacity_lives_per_s": lives,
            "capacity_users": capacity.users,
            "unloaded_lives_per_s": unloaded.acquires_per_s,
            "unloaded_p99_ms": unloaded.acquire_p99_ms,
            "max_in_flight": bound,
            "max_in_flight_rule": if c.overload_max_in_flight.is_some() { "--overload-max-in-flight" } else { "2 x capacity lock lives/s x acquire p99 at capacity, at least 5" },
            "offered_factor": c.overload_factor,
            "offered_lives_per_s": report::round(rate, 1),
            "sent_lives_per_s": report::round((due - n(&k.arrivals_skipped)) as f64 / outcome.window_s, 1),
            "workers": workers,
            "goodput_lives_per_s": report::round(goodput, 1),
            "goodput_over_capacity": report::round(goodput / lives.max(1e-9), 3),
            "admitted_acquire": r.latency,
            "admitted_acquire_p99_over_unloaded": report::round(r.acquire_p99_ms / unloaded.acquire_p99_ms.max(1e-9), 2),
            "admitted_release": ctx.release_latency.percentiles(),
            "refused_acquire": ctx.refusal_latency.percentiles(),
            "admitted_renew_batch": ctx.renew_latency.percentiles(),
            "renewals_lost": r.lost_total,
            "holders": c.overload_holders,
            "locks_per_holder": c.overload_locks_per_holder,
            "holder_ttl_ms": c.overload_ttl_ms,
            "counts": &ctx.counts,
            "outcome": &outcome,
        });
        self.records.extend([capacity, unloaded]);
        self.push(r);
        let d = &self
            .records
            .last()
            .map(|r| r.detail.clone())
            .unwrap_or_default();
        eprintln!(
            "   goodput {} lock lives/s ({} of capacity), {} acquires 503 overloaded, admitted acquire p99 {} ms ({}x unloaded), {} renewals lost, {} renew-batches 503",
            d["goodput_lives_per_s"], d["goodput_over_capacity"], d["counts"]["acquires_overloaded"],
            d["admitted_acquire"]["p99_ms"], d["admitted_acquire_p99_over_unloaded"], d["renewals_lost"],
            d["counts"]["renew_batches_refused"]
        );
        Ok(())
    }

    /// `overload-capacity` (lock lives as fast as `users` go) and
    /// `overload-unloaded` (at half that rate), for a warm pool.
    async fn capacity(&mut self, name: &str, clients: &Clients) -> Result<(Record, Record)> {
        let c = self.cfg;
        self.settle(true).await?;
        let warm = self.warm_up(clients).await?;
        let idle = self.settle(false).await?;
        let mut cap = self
            .lifecycle(
                &format!("{name}-capacity"),
                c.users,
                c.duration_s,
                None,
                clients,
            )
            .await?;
        (cap.idle, cap.warmup) = (Some(idle), Some(warm));
        let idle = self.settle(false).await?;
        let half = ((cap.acquires_per_s / 2.0).round() as usize).max(1);
        let mut unloaded = self
            .lifecycle(
                &format!("{name}-unloaded"),
                c.users,
                c.duration_s,
                Some(half),
                clients,
            )
            .await?;
        unloaded.idle = Some(idle);
        Ok((cap, unloaded))
    }

    /// The overloaded window on this bench's (bounded) router.
    async fn overloaded(
        &mut self,
        name: &str,
        rate: f64,
        workers: usize,
        bound: usize,
        clients: &Clients,
    ) -> Result<Overloaded> {
        let c = self.cfg;
        self.settle(true).await?;
        // No more acquires at once than one shard may have in flight (half
        // of the half of the slots acquires may use), so none is refused.
        let warm_users = (bound / 4).clamp(1, c.users);
        let warm = self.warm_up_with(clients, warm_users).await?;
        let idle = self.settle(false).await?;
        let ctx = Arc::new(Overload::new(
            overload::Sizes {
                ttl_ms: c.ttl_ms,
                holder_ttl_ms: c.overload_ttl_ms,
                holders: c.overload_holders,
                locks_per_holder: c.overload_locks_per_holder,
                rate,
            },
            &tag(name),
            clients.clone(),
        ));
        let ramp_limit = Duration::from_secs(30);
        let users = workers + c.overload_holders;
        // An upper bound only: the controller ends the attack.
        let bound = ramp_limit.as_secs() + c.overload_s + 30;
        let plan = self.plan(name, users, bound as usize, None);
        let controller = overload::Controller {
            ctx: ctx.clone(),
            stack: self.stack,
            window: Duration::from_secs(c.overload_s),
            ramp_limit,
        };
        let scenarios = overload::scenarios(&ctx, workers)?;
        let (metrics, outcome) = tokio::join!(attack::run(&plan, scenarios), controller.run());
        let (metrics, outcome) = (metrics?, outcome?);
        Ok(Overloaded {
            ctx,
            outcome,
            users,
            goose_failures: attack::goose_failures(&metrics),
            idle,
            warm,
        })
    }
}
