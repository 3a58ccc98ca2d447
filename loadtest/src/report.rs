//! The run's results: one [`Record`] per scenario, the ratios against the
//! targets of the benchmark, the checks `--check` enforces, and the files
//! written under the output dir (`summary.json`, `summary.md`).

use std::path::Path;

use anyhow::Result;
use serde::Serialize;
use serde_json::Value;

use crate::scrape::{Cpu, Delta};
use crate::stats::{Percentiles, Stats};

/// One scenario's figures. Field names follow the benchmark's summary
/// format; rates are over the scenario's own window.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Record {
    pub scenario: String,
    pub duration_s: f64,
    pub users: usize,
    pub throttle_rps: Option<usize>,
    pub acquires_total: u64,
    pub acquires_per_s: f64,
    /// Corrected for coordinated omission when the scenario ran at a fixed
    /// rate; raw otherwise.
    pub acquire_p50_ms: f64,
    pub acquire_p99_ms: f64,
    pub latency_raw: Percentiles,
    pub latency_corrected: Percentiles,
    pub not_acquired_total: u64,
    pub releases_total: u64,
    pub renewed_total: u64,
    pub lost_total: u64,
    pub errors_total: u64,
    pub server_errors_total: u64,
    /// Requests goose counted as failed (non-2xx, including 409 on renew).
    pub goose_failures_total: u64,
    pub requests_total: u64,
    pub router_requests_total: f64,
    pub active_leases_peak: u64,
    pub clients: usize,
    pub etcd_proposals_total: f64,
    pub etcd_proposals_per_acquire: f64,
    pub etcd_txn_rpcs_per_acquire: f64,
    pub etcd_lease_grants_per_acquire: f64,
    pub etcd_lease_revokes_per_acquire: f64,
    pub etcd_proposals_per_s: f64,
    pub etcd_keepalives_per_s: f64,
    pub router_keepalives_sent_per_s: f64,
    pub router_lease_renewals_per_s: f64,
    pub router_rss_peak_bytes: Option<u64>,
    pub router_bytes_per_lock: Option<f64>,
    /// Cores each process used on average (this machine has 2).
    pub cores: Cpu,
    pub direct_acquires_per_s: Option<f64>,
    pub naive_acquires_per_s: Option<f64>,
    pub naive_etcd_proposals_per_acquire: Option<f64>,
    /// Scenario-specific detail (fairness, hold phases, ...).
    pub detail: Value,
}

impl Record {
    /// Fills the common fields from what the users counted and what the
    /// servers' counters say happened in `delta`.
    pub fn new(scenario: &str, stats: &Stats, delta: &Delta, seconds: f64) -> Self {
        let acquires = Stats::get(&stats.acquired);
        let per_acq = |x: f64| {
            if acquires > 0 {
                x / acquires as f64
            } else {
                0.0
            }
        };
        let per_s = |x: f64| if seconds > 0.0 { x / seconds } else { 0.0 };
        let corrected = stats.latency.corrected();
        Self {
            scenario: scenario.to_string(),
            duration_s: round(seconds, 2),
            acquires_total: acquires,
            acquires_per_s: round(per_s(acquires as f64), 1),
            acquire_p50_ms: corrected.p50_ms,
            acquire_p99_ms: corrected.p99_ms,
            latency_raw: stats.latency.raw(),
            latency_corrected: corrected,
            not_acquired_total: Stats::get(&stats.not_acquired),
            releases_total: Stats::get(&stats.released),
            renewed_total: Stats::get(&stats.renewed),
            lost_total: Stats::get(&stats.lost),
            errors_total: Stats::get(&stats.errors),
            server_errors_total: Stats::get(&stats.server_errors),
            requests_total: Stats::get(&stats.requests),
            router_requests_total: delta.router.requests,
            active_leases_peak: Stats::get(&stats.active_peak),
            etcd_proposals_total: delta.etcd.proposals,
            etcd_proposals_per_acquire: round(per_acq(delta.etcd.proposals), 3),
            etcd_txn_rpcs_per_acquire: round(per_acq(delta.etcd.txn_rpcs), 3),
            etcd_lease_grants_per_acquire: round(per_acq(delta.etcd.lease_grants), 4),
            etcd_lease_revokes_per_acquire: round(per_acq(delta.etcd.lease_revokes), 4),
            etcd_proposals_per_s: round(per_s(delta.etcd.proposals), 1),
            etcd_keepalives_per_s: round(per_s(delta.etcd.lease_renewals), 1),
            router_keepalives_sent_per_s: round(per_s(delta.router.keepalives_sent), 1),
            router_lease_renewals_per_s: round(per_s(delta.router.lease_renewals), 1),
            cores: Cpu {
                loadgen: round(delta.cores.loadgen, 2),
                router: round(delta.cores.router, 2),
                etcd: round(delta.cores.etcd, 2),
                machine: round(delta.cores.machine, 2),
            },
            detail: Value::Null,
            ..Default::default()
        }
    }
}

pub fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// One target of the benchmark and whether this run met it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub name: String,
    pub measured: f64,
    pub limit: f64,
    /// How `measured` compares with `limit`: ">=" or "<=".
    pub rule: String,
    pub met: bool,
    pub note: String,
}

fn target(name: &str, measured: f64, rule: &str, limit: f64, note: String) -> Target {
    let met = match rule {
        ">=" => measured >= limit,
        _ => measured <= limit,
    };
    Target {
        name: name.to_string(),
        measured: round(measured, 3),
        limit: round(limit, 3),
        rule: rule.to_string(),
        met,
        note,
    }
}

fn find<'a>(records: &'a [Record], name: &str) -> Option<&'a Record> {
    records.iter().find(|r| r.scenario == name)
}

/// The ratios the benchmark exists to show, from the records present.
pub fn targets(records: &[Record], shards: usize, ttl_ms: u64) -> Vec<Target> {
    let mut out = Vec::new();
    let router = find(records, "uncontested");
    let direct = find(records, "direct");
    let naive = find(records, "naive");
    if let (Some(r), Some(d)) = (router, direct) {
        out.push(target(
            "router / direct acquire throughput",
            r.acquires_per_s / d.acquires_per_s.max(1e-9),
            ">=",
            0.7,
            format!(
                "{:.0} vs {:.0} acquires/s",
                r.acquires_per_s, d.acquires_per_s
            ),
        ));
    }
    if let (Some(r), Some(n)) = (router, naive) {
        out.push(target(
            "router / naive acquire throughput",
            r.acquires_per_s / n.acquires_per_s.max(1e-9),
            ">=",
            2.0,
            format!(
                "{:.0} vs {:.0} acquires/s",
                r.acquires_per_s, n.acquires_per_s
            ),
        ));
    }
    let lat_r = records
        .iter()
        .find(|r| r.scenario.starts_with("uncontested@"));
    let lat_d = records.iter().find(|r| r.scenario.starts_with("direct@"));
    if let (Some(r), Some(d)) = (lat_r, lat_d) {
        out.push(target(
            "router p99 / direct p99 at a fixed rate",
            r.acquire_p99_ms / d.acquire_p99_ms.max(1e-9),
            "<=",
            2.0,
            format!(
                "{:.2} ms vs {:.2} ms at {}",
                r.acquire_p99_ms, d.acquire_p99_ms, r.scenario
            ),
        ));
        out.push(target(
            "router p99 at a fixed rate (ms)",
            r.acquire_p99_ms,
            "<=",
            10.0,
            r.scenario.clone(),
        ));
    }
    if let Some(r) = router {
        out.push(target(
            "etcd proposals per lock lifecycle (router)",
            r.etcd_proposals_per_acquire,
            "<=",
            2.1,
            "acquire + release, session grants amortised".into(),
        ));
    }
    if let Some(n) = naive {
        out.push(target(
            "etcd proposals per lock lifecycle (naive)",
            n.etcd_proposals_per_acquire,
            ">=",
            4.0,
            "grant + txn + revoke".into(),
        ));
    }
    let period_s = ttl_ms as f64 / 3000.0;
    for (name, factor) in [("hold", 1.1), ("per-lock-renew", 2.2)] {
        if let Some(h) = find(records, name) {
            let bound = h.clients as f64 * shards as f64 / period_s;
            out.push(target(
                &format!("{name}: etcd keepalives/s / (C x shards / (TTL/3))"),
                h.etcd_keepalives_per_s / bound.max(1e-9),
                "<=",
                factor,
                format!(
                    "{:.0} keepalives/s for {} leases, {} clients",
                    h.etcd_keepalives_per_s, h.active_leases_peak, h.clients
                ),
            ));
        }
    }
    if let Some(b) = find(records, "hold").and_then(|h| h.router_bytes_per_lock) {
        out.push(target(
            "router bytes per held lock",
            b,
            "<=",
            50.0,
            "RSS slope between half and all locks held".into(),
        ));
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

/// What `--check` insists on: no failed request anywhere, and accounting
/// that adds up. Returns the problems found.
pub fn check(records: &[Record]) -> Vec<String> {
    let mut problems = Vec::new();
    for r in records {
        if r.scenario == "rebalance" {
            problems.extend(check_rebalance(r));
            continue;
        }
        if r.errors_total > 0 || r.server_errors_total > 0 {
            problems.push(format!(
                "{}: {} errors, {} 5xx",
                r.scenario, r.errors_total, r.server_errors_total
            ));
        }
        if r.acquires_total == 0 {
            problems.push(format!("{}: no lock was acquired", r.scenario));
        }
        let is_router = !(r.scenario.starts_with("direct") || r.scenario.starts_with("naive"));
        if is_router && r.router_requests_total < r.requests_total as f64 * 0.99 {
            problems.push(format!(
                "{}: the router counted {} requests, the load generator sent {}",
                r.scenario, r.router_requests_total, r.requests_total
            ));
        }
    }
    let range = |name: &str, lo: f64, hi: f64, problems: &mut Vec<String>| {
        if let Some(r) = find(records, name) {
            let p = r.etcd_proposals_per_acquire;
            if !(lo..=hi).contains(&p) {
                problems.push(format!(
                    "{name}: {p} etcd proposals per acquire, expected {lo} to {hi}"
                ));
            }
            if r.etcd_txn_rpcs_per_acquire < 0.99 {
                problems.push(format!(
                    "{name}: {} Txn RPCs per acquire, expected at least 1",
                    r.etcd_txn_rpcs_per_acquire
                ));
            }
        }
    };
    range("uncontested", 1.5, 3.0, &mut problems);
    range("direct", 1.5, 2.5, &mut problems);
    range("naive", 2.5, 4.5, &mut problems);
    for name in ["hold", "per-lock-renew"] {
        if let Some(h) = find(records, name) {
            if h.etcd_keepalives_per_s <= 0.0 || h.renewed_total == 0 {
                problems.push(format!("{name}: no renewals reached etcd"));
            }
            if let Some(reached) = h.detail.get("locks_reached").and_then(Value::as_u64) {
                let want = h
                    .detail
                    .get("locks_target")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                if reached < want {
                    problems.push(format!("{name}: reached {reached} of {want} locks"));
                }
            }
        }
    }
    problems
}

/// `rebalance` may fail acquires while the router does not grant: from the
/// reload until it grants on the new ring, and from the migration's close
/// until it grants on the closed ring (the fence windows); outside them
/// every acquire must succeed, and the migration must close.
fn check_rebalance(r: &Record) -> Vec<String> {
    let mut problems = Vec::new();
    let d = &r.detail;
    let n = |k: &str| d.get(k).and_then(Value::as_u64).unwrap_or(0);
    if d.get("reload_status").and_then(Value::as_u64) != Some(200) {
        problems.push(format!(
            "rebalance: the reload answered {}",
            d.get("reload_status").unwrap_or(&Value::Null)
        ));
    }
    if d.get("migration_closed") != Some(&Value::Bool(true)) {
        problems.push("rebalance: the migration did not close".into());
    }
    if n("server_errors_outside_fence") > 0 || n("errors_outside_fence") > 0 {
        problems.push(format!(
            "rebalance: {} errors, {} 5xx outside the fence window",
            n("errors_outside_fence"),
            n("server_errors_outside_fence")
        ));
    }
    if r.acquires_total == 0 {
        problems.push("rebalance: no lock was acquired".into());
    }
    problems
}

/// Writes `summary.json` and a Markdown table of the records.
pub fn write(out: &Path, summary: &Value, records: &[Record], targets: &[Target]) -> Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(summary)?,
    )?;
    std::fs::write(out.join("summary.md"), markdown(records, targets))?;
    Ok(())
}

fn markdown(records: &[Record], targets: &[Target]) -> String {
    let mut s = String::from(
        "| scenario | s | users | acquires/s | p50 ms | p99 ms | errors | 5xx | etcd proposals/acquire | etcd keepalives/s | cores loadgen/router/etcd/machine |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in records {
        s.push_str(&format!(
            "| {} | {:.0} | {} | {:.0} | {:.2} | {:.2} | {} | {} | {:.2} | {:.0} | {:.2} / {:.2} / {:.2} / {:.2} |\n",
            r.scenario, r.duration_s, r.users, r.acquires_per_s, r.acquire_p50_ms, r.acquire_p99_ms,
            r.errors_total, r.server_errors_total, r.etcd_proposals_per_acquire, r.etcd_keepalives_per_s,
            r.cores.loadgen, r.cores.router, r.cores.etcd, r.cores.machine
        ));
    }
    s.push_str("\n| target | measured | rule | met | note |\n|---|---|---|---|---|\n");
    for t in targets {
        s.push_str(&format!(
            "| {} | {} | {} {} | {} | {} |\n",
            t.name,
            t.measured,
            t.rule,
            t.limit,
            if t.met { "yes" } else { "no" },
            t.note
        ));
    }
    s
}
