//! The benchmark's targets, each computed from this run's records and
//! paired rounds, with whether it was met and, for a miss, what the run
//! shows about its cause (where the CPU went, why a ramp stopped). A target
//! whose scenario did not run is left out.

use serde_json::Value;

use crate::options::Config;
use crate::paired::Paired;
use crate::report::{target, Record, Target};
use crate::scrape::{Cpu, Delta};

fn find<'a>(records: &'a [Record], name: &str) -> Option<&'a Record> {
    records.iter().find(|r| r.scenario == name)
}

/// Where the CPU went in a window: what bounds every throughput figure on
/// a machine whose processes share the cores.
fn cpu(c: &Cpu, cpus: usize) -> String {
    format!(
        "machine {:.2} of {cpus} cores busy (load generator {:.2}, router {:.2}, etcd {:.2})",
        c.machine, c.loadgen, c.router, c.etcd
    )
}

/// Every target this run measured: the scale targets first, then the others.
pub fn targets(records: &[Record], shared: Option<&Paired>, cfg: &Config) -> Vec<Target> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out = Vec::new();
    if let Some(h) = find(records, "hold") {
        out.extend(hold(h, cfg, cpus));
    }
    if let (Some(alone), Some(on_hold)) = (find(records, "churn"), find(records, "churn-on-hold")) {
        out.push(
            target(
                "churn on hold / churn alone (acquires/s)",
                on_hold.acquires_per_s / alone.acquires_per_s.max(1e-9),
                ">=",
                0.8,
                format!(
                    "{:.0} vs {:.0} acquires/s, target {}/s",
                    on_hold.acquires_per_s, alone.acquires_per_s, cfg.churn_rate
                ),
            )
            .because(format!("on hold: {}", cpu(&on_hold.cores, cpus))),
        );
    }
    if let Some(p) = shared {
        out.extend(p.targets());
    }
    if let Some(c) = find(records, "contended") {
        out.push(
            target(
                "raft writes per granted acquire, contended",
                c.etcd_proposals_per_acquire,
                "<=",
                1.5,
                format!(
                    "{} users, {} names; {} granted of {} attempts",
                    c.users,
                    c.detail.get("names").unwrap_or(&Value::Null),
                    c.acquires_total,
                    c.acquires_total + c.not_acquired_total
                ),
            )
            .because(format!(
                "{:.2} Txn RPCs per grant; refused attempts that reach a txn are raft writes",
                c.etcd_txn_rpcs_per_acquire
            )),
        );
    }
    if let Some(b) = find(records, "hold").and_then(|h| h.router_bytes_per_lock) {
        out.push(target(
            "router RSS per held lock (bytes)",
            b,
            "<=",
            120.0,
            "least-squares slope of RSS over locks held, once every session exists".into(),
        ));
    }
    if let Some(o) = find(records, "overload") {
        out.extend(overload(o, cpus));
    }
    // The same, with the load generator on a CPU of its own: where the
    // admitted latency is the router's and etcd's, not the generator's.
    if let Some(o) = find(records, "overload-pinned") {
        out.extend(overload(o, cpus).into_iter().map(|mut t| {
            t.name = t
                .name
                .replacen("overload:", "overload, load generator on its own CPU:", 1);
            t
        }));
    }
    out.extend(others(records, cfg));
    out
}

/// `overload`: goodput at twice the capacity, latency of what was
/// admitted, and no held lock lost.
fn overload(o: &Record, cpus: usize) -> Vec<Target> {
    let d = &o.detail;
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let k = &d["counts"];
    let setup = format!(
        "{} lock lives/s offered open-loop ({}x the capacity {:.0}/s), max_in_flight {}",
        d["offered_lives_per_s"],
        d["offered_factor"],
        f(&d["capacity_lives_per_s"]),
        d["max_in_flight"]
    );
    let skipped = f(&k["arrivals_skipped"]);
    let generator = if skipped > 0.0 {
        format!("; the load generator skipped {skipped} arrivals (no user free)")
    } else {
        String::new()
    };
    let busy = cpu(&o.cores, cpus);
    vec![
        target(
            "overload: goodput / capacity (lock lives/s)",
            f(&d["goodput_over_capacity"]),
            ">=",
            0.9,
            format!(
                "{setup}; {} completed/s; {} acquires answered 503 overloaded",
                d["goodput_lives_per_s"], k["acquires_overloaded"]
            ),
        )
        .because(format!("{busy}{generator}")),
        target(
            "overload: p99 of admitted acquires / unloaded p99",
            f(&d["admitted_acquire_p99_over_unloaded"]),
            "<=",
            3.0,
            format!(
                "{} ms vs {} ms at {} lock lives/s",
                d["admitted_acquire"]["p99_ms"], d["unloaded_p99_ms"], d["unloaded_lives_per_s"]
            ),
        )
        .because(format!(
            "{busy}; router in flight, highest sample {}",
            d["outcome"]["router_in_flight_sampled_max"]
        )),
        target(
            "overload: renewals lost",
            o.lost_total as f64,
            "<=",
            0.0,
            format!(
                "{} holders x {} locks, TTL {} ms, renew-batch every TTL/3; {} renew-batches answered 503 and retried; worst renewal {} ms late",
                d["holders"], d["locks_per_holder"], d["holder_ttl_ms"],
                k["renew_batches_refused"], k["renew_lag_max_ms"]
            ),
        )
        .because(format!(
            "{} answered not renewed, {} confirmed more than a TTL apart",
            k["locks_not_renewed"], k["locks_lapsed"]
        )),
        target(
            "overload: 5xx other than 503",
            o.server_errors_total as f64,
            "<=",
            0.0,
            format!("{} 503s not `overloaded`", k["other_503"]),
        ),
    ]
}

/// `hold`: how many locks, renewals on schedule, and the CPU each lock
/// renewal cost etcd and the router in the steady window.
fn hold(h: &Record, cfg: &Config, cpus: usize) -> Vec<Target> {
    let d = &h.detail;
    let num = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
    let reached = num("locks_reached");
    let lag = num("renew_lag_max_ms");
    let on_schedule = lag <= cfg.ttl_ms / 6;
    let mut locks = target(
        "locks held, renewals on schedule, none lost",
        reached as f64,
        ">=",
        cfg.locks as f64,
        format!(
            "{} clients, TTL {} s; worst renewal {lag} ms late (limit TTL/6 = {} ms); {} lost{}; {} lock renewals answered shard_unavailable, retried",
            h.clients,
            cfg.ttl_ms / 1000,
            cfg.ttl_ms / 6,
            h.lost_total,
            crate::report::counts(&h.lost_by_reason),
            h.renew_retried_total
        ),
    );
    locks.met = locks.met && on_schedule && h.lost_total == 0;
    let stopped = d
        .get("ramp_stopped_by")
        .and_then(Value::as_str)
        .unwrap_or("?");
    let ramp: Option<Delta> = d
        .get("ramp")
        .and_then(|v| serde_json::from_value(v.clone()).ok());
    let mut out = vec![locks.because(format!(
        "the ramp stopped on \"{stopped}\" at {reached} locks; during the ramp {}",
        ramp.map_or("?".into(), |r| cpu(&r.cores, cpus))
    ))];
    let Some(w) = d
        .get("window")
        .and_then(|v| serde_json::from_value::<Delta>(v.clone()).ok())
    else {
        return out;
    };
    let checks = w.router.renewal_checks();
    if checks <= 0.0 {
        return out;
    }
    let note = format!(
        "steady window: {:.0} lock renewals/s ({:.1}% checked by the cache), {:.0} barriers/s, {:.0} keepalives/s, {:.1} keepalives per burst (HTTP/2 frame); {:.0} Go GC cycles of etcd's members in its {:.0} s",
        checks / w.seconds,
        100.0 * w.router.renewal_checks_cache / checks,
        w.router.cache_barriers / w.seconds,
        w.etcd.lease_renewals / w.seconds,
        w.router.keepalives_in_bursts / w.router.keepalive_bursts.max(1.0),
        w.etcd.gc_cycles,
        w.seconds
    );
    for (name, part, limit) in [
        (
            "etcd CPU per lock renewal, hold steady state (µs)",
            w.cpu_seconds.etcd,
            3.0,
        ),
        (
            "router CPU per lock renewal (µs)",
            w.cpu_seconds.router,
            2.0,
        ),
    ] {
        out.push(
            target(name, part * 1e6 / checks, "<=", limit, note.clone())
                .because(cpu(&w.cores, cpus)),
        );
    }
    out
}

/// Targets kept from earlier runs: keepalives per session, handover
/// latency, and no 5xx where none may happen.
fn others(records: &[Record], cfg: &Config) -> Vec<Target> {
    let mut out = Vec::new();
    let period_s = cfg.ttl_ms as f64 / 3000.0;
    for (name, factor) in [("hold", 1.1), ("per-lock-renew", 2.2)] {
        if let Some(h) = find(records, name) {
            let bound = h.clients as f64 * cfg.shards as f64 / period_s;
            out.push(target(
                &format!("{name}: etcd keepalives/s / (C x shards / (TTL/3))"),
                h.etcd_keepalives_per_s / bound.max(1e-9),
                "<=",
                factor,
                format!(
                    "{:.0} keepalives/s for {} locks, {} clients",
                    h.etcd_keepalives_per_s, h.active_leases_peak, h.clients
                ),
            ));
        }
    }
    if let Some(w) = find(records, "contended-wait") {
        let h = w.detail.get("handover_p99_ms").and_then(Value::as_f64);
        out.push(target(
            "contended-wait: handover p99 (ms)",
            h.unwrap_or(f64::MAX),
            "<=",
            20.0,
            "release sent to the next waiter's grant answered".into(),
        ));
    }
    if let Some(r) = find(records, "rebalance") {
        let n = r
            .detail
            .get("server_errors_outside_fence")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        out.push(target(
            "rebalance: 5xx outside the fence window",
            n as f64,
            "<=",
            0.0,
            format!(
                "{} 503 in all; fence windows: {} ms at the reload, {} ms at the close",
                r.detail.get("status_503").unwrap_or(&Value::Null),
                r.detail.get("fence_window_ms").unwrap_or(&Value::Null),
                r.detail
                    .get("close_fence_window_ms")
                    .unwrap_or(&Value::Null)
            ),
        ));
    }
    for r in records
        .iter()
        .filter(|r| r.scenario.starts_with("contended") || r.scenario.starts_with("churn"))
    {
        out.push(target(
            &format!("{}: 5xx answers", r.scenario),
            r.server_errors_total as f64,
            "<=",
            0.0,
            String::new(),
        ));
    }
    out
}
