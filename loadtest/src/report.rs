//! The run's results: one [`Record`] per measured window, and the files
//! written under the output dir (`summary.json`, `summary.md`). The
//! targets are in `targets`, what `--check` insists on in `checks`, the
//! paired comparison in `paired`.

use serde::Serialize;
use serde_json::Value;

use crate::idle::IdleCheck;
use crate::scenarios::warmup::WarmupOutcome;
use crate::scrape::{Cpu, Delta};
pub use crate::stats::round;
use crate::stats::{Percentiles, Stats};

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
    /// 5xx answers by status and error code (`503 overloaded`), where the
    /// body was read.
    pub server_errors_by: std::collections::BTreeMap<String, u64>,
    /// The first message of each of those.
    pub server_error_first: std::collections::BTreeMap<String, String>,
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
    /// The p99 of acquires' time in the router, and of etcd's answers to
    /// the router's txns meanwhile, from the router's histograms (None:
    /// the router served no acquire).
    pub router_acquire_p99_ms: Option<f64>,
    pub router_etcd_txn_p99_ms: Option<f64>,
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
    /// The 5xx answers by status and error code, as " (503 overloaded 12)",
    /// or nothing when none was counted.
    pub fn server_error_causes(&self) -> String {
        counts(&self.server_errors_by)
    }

    /// The first message of each kind of 5xx, a line each, or nothing.
    pub fn server_error_messages(&self) -> String {
        self.server_error_first
            .iter()
            .map(|(k, m)| format!("\n     first {k}: {m}"))
            .collect()
    }

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
        let acquire_p99 = p99_ms(&r.acquire_seconds);
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
            server_errors_by: stats.server_errors_by(),
            server_error_first: stats.server_error_first(),
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
            router_acquire_p99_ms: acquire_p99,
            // Only beside acquires the router served: without them its txns
            // are its barriers and probes.
            router_etcd_txn_p99_ms: acquire_p99.and(p99_ms(&r.etcd_txn_seconds)),
            cores: c(&delta.cores, 2),
            cpu_seconds: c(&delta.cpu_seconds, 3),
            detail: Value::Null,
            ..Default::default()
        }
    }
}

/// The p99 of cumulative buckets in seconds, in ms.
fn p99_ms(buckets: &[(f64, f64)]) -> Option<f64> {
    lockrouter_testkit::metrics::quantile(buckets, 0.99).map(|s| round(s * 1000.0, 2))
}

/// One target and this run's figure for it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub name: String,
    pub measured: f64,
    /// How `measured` compares with `limit`: ">=", "<=" or "<".
    pub rule: String,
    pub limit: f64,
    pub met: bool,
    /// How it was measured.
    pub note: String,
    /// For a miss: what the run shows about why (empty when met).
    pub cause: String,
}

pub fn target(name: &str, measured: f64, rule: &str, limit: f64, note: String) -> Target {
    let met = match rule {
        ">=" => measured >= limit,
        "<" => measured < limit,
        _ => measured <= limit,
    };
    Target {
        name: name.to_string(),
        measured: round(measured, 3),
        rule: rule.to_string(),
        limit,
        met,
        note,
        cause: String::new(),
    }
}

impl Target {
    /// Sets the cause, kept only for a miss.
    pub fn because(mut self, cause: String) -> Self {
        if !self.met {
            self.cause = cause;
        }
        self
    }
}

/// ` (expired 3, shard_unavailable 2)`: counts by cause, or nothing when
/// there are none.
pub fn counts(by: &std::collections::BTreeMap<String, u64>) -> String {
    if by.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = by.iter().map(|(k, n)| format!("{k} {n}")).collect();
    format!(" ({})", parts.join(", "))
}
