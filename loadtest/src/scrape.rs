//! Accounting from the servers' own metrics: each shard's etcd `/metrics`
//! (raft proposals, Txn RPCs, lease grants, revokes and keepalives,
//! compactions) and the router's `/metrics` (keepalives it sent, renewals
//! asked of it, requests, group commits, cache barriers and renewal checks),
//! plus the CPU time of every process. A [`Snapshot`] is taken before and
//! after each scenario; the [`Delta`] between two is what the scenario cost.

use std::time::Instant;

use anyhow::Result;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::metrics;
use lockrouter_testkit::procfs::{cpu_seconds, machine_busy_seconds};
use serde::{Deserialize, Serialize};

use crate::stack::Stack;

/// The etcd counters the benchmark reads, for one shard or summed.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct EtcdCounters {
    /// Raft entries committed (every write: put, txn with a write, grant, revoke).
    pub proposals: f64,
    /// Txn RPCs handled (`etcd_mvcc_txn_total` misses single-op txns).
    pub txn_rpcs: f64,
    pub lease_grants: f64,
    pub lease_revokes: f64,
    /// Keepalives the leader handled.
    pub lease_renewals: f64,
    /// History compactions run (the periodic compactor's, here).
    pub compactions: f64,
    /// Go garbage collections, every member's own, summed. A collection
    /// marks the whole heap (a million lock keys make it hundreds of MB),
    /// so how many fall in a window moves etcd's CPU in it.
    #[serde(default)]
    pub gc_cycles: f64,
}

impl EtcdCounters {
    fn parse(text: &str) -> Self {
        Self {
            proposals: metrics::sum(text, "etcd_server_proposals_committed_total", &[]),
            txn_rpcs: metrics::sum(text, "grpc_server_handled_total", &[("grpc_method", "Txn")]),
            lease_grants: metrics::sum(text, "etcd_debugging_lease_granted_total", &[]),
            lease_revokes: metrics::sum(text, "etcd_debugging_lease_revoked_total", &[]),
            lease_renewals: metrics::sum(text, "etcd_debugging_lease_renewed_total", &[]),
            compactions: metrics::sum(
                text,
                "etcd_debugging_mvcc_db_compaction_total_duration_milliseconds_count",
                &[],
            ),
            gc_cycles: metrics::sum(text, "go_gc_duration_seconds_count", &[]),
        }
    }

    pub fn minus(&self, o: &Self) -> Self {
        Self {
            proposals: self.proposals - o.proposals,
            txn_rpcs: self.txn_rpcs - o.txn_rpcs,
            lease_grants: self.lease_grants - o.lease_grants,
            lease_revokes: self.lease_revokes - o.lease_revokes,
            lease_renewals: self.lease_renewals - o.lease_renewals,
            compactions: self.compactions - o.compactions,
            gc_cycles: self.gc_cycles - o.gc_cycles,
        }
    }

    fn plus(&self, o: &Self) -> Self {
        Self {
            proposals: self.proposals + o.proposals,
            txn_rpcs: self.txn_rpcs + o.txn_rpcs,
            lease_grants: self.lease_grants + o.lease_grants,
            lease_revokes: self.lease_revokes + o.lease_revokes,
            lease_renewals: self.lease_renewals + o.lease_renewals,
            compactions: self.compactions + o.compactions,
            gc_cycles: self.gc_cycles + o.gc_cycles,
        }
    }

    /// Two members of one shard as the shard: what every member does for
    /// each entry it applies (commit a proposal, grant or revoke a lease,
    /// compact) is counted once, the most either counted; what only the
    /// member a request reached handles (a Txn RPC, a keepalive, which the
    /// leader alone renews) is summed.
    fn with_member(&self, o: &Self) -> Self {
        Self {
            proposals: self.proposals.max(o.proposals),
            txn_rpcs: self.txn_rpcs + o.txn_rpcs,
            lease_grants: self.lease_grants.max(o.lease_grants),
            lease_revokes: self.lease_revokes.max(o.lease_revokes),
            lease_renewals: self.lease_renewals + o.lease_renewals,
            compactions: self.compactions.max(o.compactions),
            gc_cycles: self.gc_cycles + o.gc_cycles,
        }
    }

    /// One shard's counters now, over all its members.
    fn of_shard(shard: &EtcdCluster) -> std::io::Result<Self> {
        let mut total = Self::parse(&shard.metrics_text(0)?);
        for i in 1..shard.endpoints().len() {
            total = total.with_member(&Self::parse(&shard.metrics_text(i)?));
        }
        Ok(total)
    }

    /// Every shard's counters now, summed (the idle check reads only these).
    pub fn read(stack: &Stack) -> Result<Self> {
        let mut sum = Self::default();
        for s in &stack.shards {
            sum = sum.plus(&Self::of_shard(s)?);
        }
        Ok(sum)
    }
}

/// The router counters the benchmark reads.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RouterCounters {
    /// Keepalives the router sent to etcd (after coalescing).
    pub keepalives_sent: f64,
    /// Lease renewals asked of the router's keepalive loops (before coalescing).
    pub lease_renewals: f64,
    /// API requests served, all operations and outcomes.
    pub requests: f64,
    /// Session leases cached (a gauge: a delta keeps the later value).
    pub session_leases: f64,
    /// Session leases the router granted.
    pub session_grants: f64,
    /// Group commits (one etcd txn each) of grants and releases, and the
    /// grants and releases they carried.
    pub commits: f64,
    pub committed: f64,
    /// Barriers written so that renewals may trust the lock-key cache.
    pub cache_barriers: f64,
    /// Lock renewals checked by the cache, and by reads of etcd when the
    /// cache could not vouch.
    pub renewal_checks_cache: f64,
    pub renewal_checks_read: f64,
    /// Bursts the main keepalive streams wrote (one HTTP/2 frame each),
    /// and the keepalives in them.
    #[serde(default)]
    pub keepalive_bursts: f64,
    #[serde(default)]
    pub keepalives_in_bursts: f64,
    /// Spare session leases granted ahead of need, and those new sessions
    /// started on (the rest expired unused).
    #[serde(default)]
    pub spares_granted: f64,
    #[serde(default)]
    pub spares_used: f64,
    /// Acquires' time in the router, and etcd's answers to the router's
    /// txns (group commits, barriers, probes), as cumulative histogram
    /// buckets by upper bound in seconds.
    #[serde(skip)]
    pub acquire_seconds: Vec<(f64, f64)>,
    #[serde(skip)]
    pub etcd_txn_seconds: Vec<(f64, f64)>,
}

/// `lockrouter_spare_leases_total` of one `event`, summed over shards.
fn spares(text: &str, event: &str) -> f64 {
    metrics::sum(text, "lockrouter_spare_leases_total", &[("event", event)]) + 0.0
}

impl RouterCounters {
    fn parse(text: &str) -> Self {
        Self {
            keepalives_sent: metrics::sum(text, "lockrouter_keepalives_sent_total", &[]),
            lease_renewals: metrics::sum(text, "lockrouter_lease_renewals_total", &[]),
            requests: metrics::sum(text, "lockrouter_requests_total", &[]),
            session_leases: metrics::sum(text, "lockrouter_session_leases", &[]),
            session_grants: metrics::sum(text, "lockrouter_session_grants_total", &[]),
            commits: metrics::sum(text, "lockrouter_commits_total", &[]),
            committed: metrics::sum(text, "lockrouter_commit_batch_size_sum", &[]),
            cache_barriers: metrics::sum(text, "lockrouter_cache_barriers_total", &[]),
            renewal_checks_cache: metrics::sum(
                text,
                "lockrouter_renewal_checks_total",
                &[("by", "cache")],
            ),
            renewal_checks_read: metrics::sum(
                text,
                "lockrouter_renewal_checks_total",
                &[("by", "read")],
            ),
            keepalive_bursts: metrics::sum(text, "lockrouter_keepalive_burst_size_count", &[]),
            keepalives_in_bursts: metrics::sum(text, "lockrouter_keepalive_burst_size_sum", &[]),
            spares_granted: spares(text, "granted"),
            spares_used: spares(text, "used"),
            acquire_seconds: metrics::buckets(
                text,
                "lockrouter_request_duration_seconds",
                &[("op", "acquire")],
            ),
            etcd_txn_seconds: metrics::buckets(
                text,
                "lockrouter_etcd_request_duration_seconds",
                &[("rpc", "Txn")],
            ),
        }
    }

    fn minus(&self, o: &Self) -> Self {
        Self {
            keepalives_sent: self.keepalives_sent - o.keepalives_sent,
            lease_renewals: self.lease_renewals - o.lease_renewals,
            requests: self.requests - o.requests,
            session_leases: self.session_leases,
            session_grants: self.session_grants - o.session_grants,
            commits: self.commits - o.commits,
            committed: self.committed - o.committed,
            cache_barriers: self.cache_barriers - o.cache_barriers,
            renewal_checks_cache: self.renewal_checks_cache - o.renewal_checks_cache,
            renewal_checks_read: self.renewal_checks_read - o.renewal_checks_read,
            keepalive_bursts: self.keepalive_bursts - o.keepalive_bursts,
            keepalives_in_bursts: self.keepalives_in_bursts - o.keepalives_in_bursts,
            spares_granted: self.spares_granted - o.spares_granted,
            spares_used: self.spares_used - o.spares_used,
            acquire_seconds: metrics::buckets_since(&self.acquire_seconds, &o.acquire_seconds),
            etcd_txn_seconds: metrics::buckets_since(&self.etcd_txn_seconds, &o.etcd_txn_seconds),
        }
    }

    /// Lock renewals checked, by the cache or by reads.
    pub fn renewal_checks(&self) -> f64 {
        self.renewal_checks_cache + self.renewal_checks_read
    }
}

/// CPU seconds used so far by each process of the run, and by the whole
/// machine (anything else running shows as the difference).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Cpu {
    pub loadgen: f64,
    pub router: f64,
    pub etcd: f64,
    pub machine: f64,
}

/// Everything read at one moment.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub at: Instant,
    pub etcd: Vec<EtcdCounters>,
    pub router: RouterCounters,
    pub cpu: Cpu,
}

impl Snapshot {
    pub fn take(stack: &Stack) -> Result<Self> {
        let etcd = stack
            .shards
            .iter()
            .map(EtcdCounters::of_shard)
            .collect::<std::io::Result<Vec<_>>>()?;
        let router = RouterCounters::parse(&stack.router.metrics_text()?);
        let cpu = Cpu {
            loadgen: cpu_seconds(std::process::id()).unwrap_or(0.0),
            router: cpu_seconds(stack.router.pid()).unwrap_or(0.0),
            etcd: stack
                .shards
                .iter()
                .flat_map(crate::stack::member_pids)
                .filter_map(cpu_seconds)
                .sum(),
            machine: machine_busy_seconds(),
        };
        Ok(Self {
            at: Instant::now(),
            etcd,
            router,
            cpu,
        })
    }

    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Snapshot) -> Delta {
        let per_shard: Vec<EtcdCounters> = self
            .etcd
            .iter()
            .zip(&before.etcd)
            .map(|(a, b)| a.minus(b))
            .collect();
        let etcd = per_shard
            .iter()
            .fold(EtcdCounters::default(), |acc, s| acc.plus(s));
        let seconds = self.at.duration_since(before.at).as_secs_f64();
        let cpu = Cpu {
            loadgen: self.cpu.loadgen - before.cpu.loadgen,
            router: self.cpu.router - before.cpu.router,
            etcd: self.cpu.etcd - before.cpu.etcd,
            machine: self.cpu.machine - before.cpu.machine,
        };
        let per_s = |x: f64| x / seconds.max(1e-9);
        Delta {
            seconds,
            etcd,
            etcd_per_shard: per_shard,
            router: self.router.minus(&before.router),
            cores: Cpu {
                loadgen: per_s(cpu.loadgen),
                router: per_s(cpu.router),
                etcd: per_s(cpu.etcd),
                machine: per_s(cpu.machine),
            },
            cpu_seconds: cpu,
        }
    }
}

/// Counters over a window, summed over shards, the CPU seconds each process
/// used in it, and the cores that is on average (the machine's CPU count is
/// all of it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Delta {
    pub seconds: f64,
    pub etcd: EtcdCounters,
    pub etcd_per_shard: Vec<EtcdCounters>,
    pub router: RouterCounters,
    pub cores: Cpu,
    pub cpu_seconds: Cpu,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shards_members_share_its_proposals_and_count_their_own_collections() {
        let member = |proposals: u32, collections: u32| {
            EtcdCounters::parse(&format!(
                "etcd_server_proposals_committed_total {proposals}\n\
                 go_gc_duration_seconds{{quantile=\"0.5\"}} 0.0001\n\
                 go_gc_duration_seconds_count {collections}\n"
            ))
        };
        let shard = member(10, 3).with_member(&member(9, 4));
        assert_eq!((shard.proposals, shard.gc_cycles), (10.0, 7.0));
    }
}
