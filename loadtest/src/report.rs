//! The run's results: one [`Record`] per measured window, and the files
//! written under the output dir (`summary.json`, `summary.md`). The
//! targets are in `targets`, what `--check` insists on in `checks`, the
//! paired comparison in `paired`.

use std::path::Path;

use anyhow::Result;
use serde::Serialize;
use serde_json::Value;

use crate::idle::IdleCheck;
use crate::paired::Paired;
use crate::scenarios::warmup::WarmupOutcome;
use crate::scrape::{Cpu, Delta};
use crate::stats::{Percentiles, Stats};
use crate::targets::Target;

/// One measured window's figures. Rates are over the window's own span
/// (first request to last); costs per acquire are over the counters read
/// before and after it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Record {
    pub scenario: String,
    /// The CPU placement it ran with: `shared` (every process on every
    /// CPU) or `pinned` (etcd on a CPU of its own).
    pub table: String,
    /// Its paired round (from 1), for the router and baseline windows.
    pub round: Option<usize>,
    pub duration_s: f64,
    pub users: usize,
    pub throttle_rps: Option<usize>,
    /// Distinct clientIds its locks were acquired for.
    pub clients: usize,
    pub acquires_total: u64,
    pub acquires_per_s: f64,
    pub acquire_p50_ms: f64,
    pub acquire_p99_ms: f64,
    pub latency: Percentiles,
    /// Most requests in flight at once; below `users`, no send waited for
    /// an earlier answer.
    pub in_flight_peak: u64,
    pub not_acquired_total: u64,
    pub releases_total: u64,
    pub renewed_total: u64,
    pub lost_total: u64,
    /// `lost_total` by the router's reason.
    pub lost_by_reason: std::collections::BTreeMap<String, u64>,
    /// Lock renewals answered `shard_unavailable` and retried.
    pub renew_retried_total: u64,
    pub errors_total: u64,
    pub server_errors_total: u64,
    /// Requests goose counted as failed (non-2xx, including 409 on renew).
    pub goose_failures_total: u64,
    pub requests_total: u64,
    pub router_requests_total: f64,
    pub active_leases_peak: u64,
    pub etcd_proposals_total: f64,
    pub etcd_proposals_per_acquire: f64,
    pub etcd_txn_rpcs_per_acquire: f64,
    pub etcd_lease_grants_total: f64,
    pub etcd_lease_grants_per_acquire: f64,
    pub etcd_lease_revokes_per_acquire: f64,
    pub etcd_keepalives_per_acquire: f64,
    pub etcd_proposals_per_s: f64,
    pub etcd_keepalives_per_s: f64,
    /// History compactions etcd ran during the window.
    pub etcd_compactions: f64,
    pub router_keepalives_sent_per_s: f64,
    pub router_lease_renewals_per_s: f64,
    /// Grants and releases per group commit (None: no commit counted).
    pub router_commit_batch_mean: Option<f64>,
    pub router_rss_peak_bytes: Option<u64>,
    pub router_bytes_per_lock: Option<f64>,
    /// Cores each process used on average, and its CPU seconds.
    pub cores: Cpu,
    pub cpu_seconds: Cpu,
    /// The idle check just before the window.
    pub idle: Option<IdleCheck>,
    /// The session warm-up before it, if any.
    pub warmup: Option<WarmupOutcome>,
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
        let latency = stats.latency.percentiles();
        let r = &delta.router;
        let c = |x: &Cpu, digits| Cpu {
            loadgen: round(x.loadgen, digits),
            router: round(x.router, digits),
            etcd: round(x.etcd, digits),
            machine: round(x.machine, digits),
        };
        Self {
            scenario: scenario.to_string(),
            duration_s: round(seconds, 2),
            acquires_total: acquires,
            acquires_per_s: round(per_s(acquires as f64), 1),
            acquire_p50_ms: latency.p50_ms,
            acquire_p99_ms: latency.p99_ms,
            latency,
            in_flight_peak: Stats::get(&stats.in_flight_peak),
            not_acquired_total: Stats::get(&stats.not_acquired),
            releases_total: Stats::get(&stats.released),
            renewed_total: Stats::get(&stats.renewed),
            lost_total: Stats::get(&stats.lost),
            lost_by_reason: stats.lost_by(),
            renew_retried_total: Stats::get(&stats.renew_retried),
            errors_total: Stats::get(&stats.errors),
            server_errors_total: Stats::get(&stats.server_errors),
            requests_total: Stats::get(&stats.requests),
            router_requests_total: r.requests,
            active_leases_peak: Stats::get(&stats.active_peak),
            etcd_proposals_total: delta.etcd.proposals,
            etcd_proposals_per_acquire: round(per_acq(delta.etcd.proposals), 3),
            etcd_txn_rpcs_per_acquire: round(per_acq(delta.etcd.txn_rpcs), 3),
            etcd_lease_grants_total: delta.etcd.lease_grants,
            etcd_lease_grants_per_acquire: round(per_acq(delta.etcd.lease_grants), 4),
            etcd_lease_revokes_per_acquire: round(per_acq(delta.etcd.lease_revokes), 4),
            etcd_keepalives_per_acquire: round(per_acq(delta.etcd.lease_renewals), 3),
            etcd_proposals_per_s: round(per_s(delta.etcd.proposals), 1),
            etcd_keepalives_per_s: round(per_s(delta.etcd.lease_renewals), 1),
            etcd_compactions: delta.etcd.compactions,
            router_keepalives_sent_per_s: round(per_s(r.keepalives_sent), 1),
            router_lease_renewals_per_s: round(per_s(r.lease_renewals), 1),
            router_commit_batch_mean: (r.commits > 0.0).then(|| round(r.committed / r.commits, 2)),
            cores: c(&delta.cores, 2),
            cpu_seconds: c(&delta.cpu_seconds, 3),
            detail: Value::Null,
            ..Default::default()
        }
    }
}

pub fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

/// Writes `summary.json` and `summary.md`.
pub fn write(
    out: &Path,
    summary: &Value,
    records: &[Record],
    paired: &[Paired],
    targets: &[Target],
) -> Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(summary)?,
    )?;
    std::fs::write(out.join("summary.md"), markdown(records, paired, targets))?;
    Ok(())
}

fn markdown(records: &[Record], paired: &[Paired], targets: &[Target]) -> String {
    let mut s = String::from("## Targets\n\n");
    s.push_str(&crate::targets::markdown(targets));
    for p in paired {
        s.push('\n');
        s.push_str(&p.markdown());
    }
    s.push_str(&overload_markdown(records, "overload", "Overload"));
    s.push_str(&overload_markdown(
        records,
        "overload-pinned",
        "Overload, the load generator on a CPU of its own",
    ));
    s.push_str(
        "\n## Every window\n\n| scenario | table | round | s | users | clients | acquires/s | p50 ms | p99 ms | max ms | most in flight | errors | 5xx | raft writes/acquire | grants/acquire | keepalives/acquire | commit batch | cores loadgen/router/etcd/machine | idle before |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in records {
        let idle = match &r.idle {
            Some(i) if i.idle => format!("yes ({} ms)", i.waited_ms),
            Some(i) => format!(
                "NO ({} proposals, {} keepalives)",
                i.proposals, i.keepalives
            ),
            None => "–".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} | {} | {:.0} | {:.2} | {:.2} | {:.1} | {} | {} | {} | {:.3} | {:.4} | {:.3} | {} | {:.2} / {:.2} / {:.2} / {:.2} | {} |\n",
            r.scenario,
            r.table,
            r.round.map_or("–".into(), |n| n.to_string()),
            r.duration_s,
            r.users,
            r.clients,
            r.acquires_per_s,
            r.acquire_p50_ms,
            r.acquire_p99_ms,
            r.latency.max_ms,
            r.in_flight_peak,
            r.errors_total,
            r.server_errors_total,
            r.etcd_proposals_per_acquire,
            r.etcd_lease_grants_per_acquire,
            r.etcd_keepalives_per_acquire,
            r.router_commit_batch_mean.map_or("–".into(), |b| b.to_string()),
            r.cores.loadgen,
            r.cores.router,
            r.cores.etcd,
            r.cores.machine,
            idle
        ));
    }
    s
}

/// `overload` side by side: the capacity and unloaded windows it was
/// sized from, and the overloaded window (empty if it did not run).
fn overload_markdown(records: &[Record], name: &str, title: &str) -> String {
    let find = |name: &str| records.iter().find(|r| r.scenario == name);
    let (Some(cap), Some(un), Some(o)) = (
        find(&format!("{name}-capacity")),
        find(&format!("{name}-unloaded")),
        find(name),
    ) else {
        return String::new();
    };
    let d = &o.detail;
    let k = &d["counts"];
    let mut s = format!(
        "\n## {title}\n\nThe router's capacity and unloaded latency, then {}x that capacity offered open-loop to a router with `server.max_in_flight = {}` ({}), while {} holders renew {} locks each (TTL {} ms).\n\n",
        d["offered_factor"], d["max_in_flight"], d["max_in_flight_rule"].as_str().unwrap_or("?"),
        d["holders"], d["locks_per_holder"], d["holder_ttl_ms"]
    );
    s.push_str("| window | load | lock lives/s | acquire p50 ms | p99 ms | max ms | 503 overloaded | cores loadgen/router/etcd/machine |\n|---|---|---|---|---|---|---|---|\n");
    for (r, load, refused) in [
        (
            cap,
            format!("{} users, closed loop", cap.users),
            "–".to_string(),
        ),
        (
            un,
            format!("{} lock lives/s", un.throttle_rps.unwrap_or(0) / 2),
            "–".to_string(),
        ),
        (
            o,
            format!("{} lock lives/s open-loop", d["offered_lives_per_s"]),
            k["acquires_overloaded"].to_string(),
        ),
    ] {
        let lives = if r.scenario == name {
            d["goodput_lives_per_s"].as_f64().unwrap_or(0.0)
        } else {
            r.acquires_per_s
        };
        s.push_str(&format!(
            "| {} | {load} | {lives:.0} | {:.2} | {:.2} | {:.1} | {refused} | {:.2} / {:.2} / {:.2} / {:.2} |\n",
            r.scenario, r.acquire_p50_ms, r.acquire_p99_ms, r.latency.max_ms,
            r.cores.loadgen, r.cores.router, r.cores.etcd, r.cores.machine
        ));
    }
    let rows = [
        ("goodput / capacity", d["goodput_over_capacity"].to_string()),
        (
            "admitted acquire p99 / unloaded p99",
            d["admitted_acquire_p99_over_unloaded"].to_string(),
        ),
        (
            "admitted release p99 (ms)",
            d["admitted_release"]["p99_ms"].to_string(),
        ),
        (
            "503 answer to an acquire, p99 (ms)",
            d["refused_acquire"]["p99_ms"].to_string(),
        ),
        (
            "lock lives sent / offered per s",
            format!("{} / {}", d["sent_lives_per_s"], d["offered_lives_per_s"]),
        ),
        (
            "arrivals skipped (no generator user free)",
            k["arrivals_skipped"].to_string(),
        ),
        (
            "releases answered 503 (retried), given up",
            format!("{}, {}", k["releases_refused"], k["releases_given_up"]),
        ),
        (
            "acquires answered 429",
            k["acquires_rate_limited"].to_string(),
        ),
        (
            "503 not `overloaded`; refusals without Retry-After",
            format!("{}; {}", k["other_503"], k["refusals_without_retry_after"]),
        ),
        (
            "5xx other than 503; other request errors",
            format!("{}; {}", o.server_errors_total, o.errors_total),
        ),
        (
            "renewals lost (not renewed + lapsed)",
            format!(
                "{} ({} + {})",
                o.lost_total, k["locks_not_renewed"], k["locks_lapsed"]
            ),
        ),
        (
            "renew-batches, answered 503 (retried)",
            format!("{}, {}", k["renew_batches"], k["renew_batches_refused"]),
        ),
        (
            "lock renewals answered shard_unavailable (retried, not lost)",
            k["locks_unavailable"].to_string(),
        ),
        (
            "admitted renew-batch p99 (ms); worst renewal lateness (ms)",
            format!(
                "{}; {}",
                d["admitted_renew_batch"]["p99_ms"], k["renew_lag_max_ms"]
            ),
        ),
        (
            "router requests in flight, highest sample; generator's most outstanding",
            format!(
                "{}; {}",
                d["outcome"]["router_in_flight_sampled_max"], o.in_flight_peak
            ),
        ),
    ];
    s.push_str("\n| figure | value |\n|---|---|\n");
    for (what, value) in rows {
        s.push_str(&format!("| {what} | {value} |\n"));
    }
    s
}
