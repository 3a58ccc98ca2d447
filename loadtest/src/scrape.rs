//! Accounting from the servers' own metrics: each shard's etcd `/metrics`
//! (raft proposals, Txn RPCs, lease grants, revokes and keepalives) and the
//! router's `/metrics` (keepalives it sent, renewals asked of it, requests),
//! plus the CPU time of every process. A [`Snapshot`] is taken before and
//! after each scenario; the [`Delta`] between two is what the scenario cost.

use std::time::Instant;

use anyhow::Result;
use lockrouter_testkit::metrics;
use lockrouter_testkit::procfs::{cpu_seconds, machine_busy_seconds};
use serde::Serialize;

use crate::stack::Stack;

/// The etcd counters the benchmark reads, for one shard or summed.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct EtcdCounters {
    /// Raft entries committed (every write: put, txn with a write, grant, revoke).
    pub proposals: f64,
    /// Txn RPCs handled (`etcd_mvcc_txn_total` misses single-op txns).
    pub txn_rpcs: f64,
    pub lease_grants: f64,
    pub lease_revokes: f64,
    /// Keepalives the leader handled.
    pub lease_renewals: f64,
}

impl EtcdCounters {
    fn parse(text: &str) -> Self {
        Self {
            proposals: metrics::sum(text, "etcd_server_proposals_committed_total", &[]),
            txn_rpcs: metrics::sum(text, "grpc_server_handled_total", &[("grpc_method", "Txn")]),
            lease_grants: metrics::sum(text, "etcd_debugging_lease_granted_total", &[]),
            lease_revokes: metrics::sum(text, "etcd_debugging_lease_revoked_total", &[]),
            lease_renewals: metrics::sum(text, "etcd_debugging_lease_renewed_total", &[]),
        }
    }

    fn minus(&self, o: &Self) -> Self {
        Self {
            proposals: self.proposals - o.proposals,
            txn_rpcs: self.txn_rpcs - o.txn_rpcs,
            lease_grants: self.lease_grants - o.lease_grants,
            lease_revokes: self.lease_revokes - o.lease_revokes,
            lease_renewals: self.lease_renewals - o.lease_renewals,
        }
    }

    fn plus(&self, o: &Self) -> Self {
        Self {
            proposals: self.proposals + o.proposals,
            txn_rpcs: self.txn_rpcs + o.txn_rpcs,
            lease_grants: self.lease_grants + o.lease_grants,
            lease_revokes: self.lease_revokes + o.lease_revokes,
            lease_renewals: self.lease_renewals + o.lease_renewals,
        }
    }
}

/// The router counters the benchmark reads.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct RouterCounters {
    /// Keepalives the router sent to etcd (after coalescing).
    pub keepalives_sent: f64,
    /// Lease renewals asked of the router's keepalive loops (before coalescing).
    pub lease_renewals: f64,
    /// API requests served, all operations and outcomes.
    pub requests: f64,
    /// Session leases cached (a gauge).
    pub session_leases: f64,
}

impl RouterCounters {
    fn parse(text: &str) -> Self {
        Self {
            keepalives_sent: metrics::sum(text, "lockrouter_keepalives_sent_total", &[]),
            lease_renewals: metrics::sum(text, "lockrouter_lease_renewals_total", &[]),
            requests: metrics::sum(text, "lockrouter_requests_total", &[]),
            session_leases: metrics::sum(text, "lockrouter_session_leases", &[]),
        }
    }
}

/// CPU seconds used so far by each process of the run, and by the whole
/// machine (anything else running shows as the difference).
#[derive(Debug, Clone, Copy, Default, Serialize)]
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
            .map(|s| s.metrics_text(0).map(|t| EtcdCounters::parse(&t)))
            .collect::<std::io::Result<Vec<_>>>()?;
        let router = RouterCounters::parse(&stack.router.metrics_text()?);
        let cpu = Cpu {
            loadgen: cpu_seconds(std::process::id()).unwrap_or(0.0),
            router: cpu_seconds(stack.router.pid()).unwrap_or(0.0),
            etcd: stack
                .shards
                .iter()
                .filter_map(|s| s.pid(0).and_then(cpu_seconds))
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
        Delta {
            seconds,
            etcd,
            etcd_per_shard: per_shard,
            router: RouterCounters {
                keepalives_sent: self.router.keepalives_sent - before.router.keepalives_sent,
                lease_renewals: self.router.lease_renewals - before.router.lease_renewals,
                requests: self.router.requests - before.router.requests,
                session_leases: self.router.session_leases,
            },
            cores: Cpu {
                loadgen: (self.cpu.loadgen - before.cpu.loadgen) / seconds.max(1e-9),
                router: (self.cpu.router - before.cpu.router) / seconds.max(1e-9),
                etcd: (self.cpu.etcd - before.cpu.etcd) / seconds.max(1e-9),
                machine: (self.cpu.machine - before.cpu.machine) / seconds.max(1e-9),
            },
        }
    }
}

/// Counters over a window, summed over shards, and the cores each process
/// used on average in it (2.0 is all of this machine).
#[derive(Debug, Clone, Serialize)]
pub struct Delta {
    pub seconds: f64,
    pub etcd: EtcdCounters,
    pub etcd_per_shard: Vec<EtcdCounters>,
    pub router: RouterCounters,
    pub cores: Cpu,
}
