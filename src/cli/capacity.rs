//! The capacity model behind `lockrouter plan`: how many etcd clusters
//! (shards) a workload needs.
//!
//! Pure arithmetic over the workload an operator expects and per-shard
//! limits measured on real etcd; nothing here touches the network or the
//! command line. The model
//! (what each lock, acquire, renewal and session costs a shard), its formulas
//! and where every default comes from are in `docs/capacity.md`; keep the two
//! in step.

use serde::Serialize;

use crate::config::ShardSettings;
use crate::placement::ring::Ring;

/// Defaults measured on real etcd. `docs/capacity.md` says how; the load-test
/// suite (`docs/benchmarks.md`) may refine them.
pub mod calibration {
    /// Raft writes/s of one shard: ~9.8K txn acquires/s, one raft write
    /// each (single etcd 3.4.23, 2 cores, 64 concurrent requests).
    pub const RAFT_WRITES_PER_SEC: f64 = 9_800.0;
    /// Lease keepalives/s one shard's leader answered (same setup).
    pub const KEEPALIVES_PER_SEC: f64 = 12_000.0;
    /// Backend bytes per live lock key (key, value, bbolt overhead after churn).
    pub const DB_BYTES_PER_KEY: f64 = 330.0;
    /// Backend bytes per revision kept until compaction (a put or a delete).
    pub const DB_BYTES_PER_REVISION: f64 = 160.0;
    /// Backend bytes per lease.
    pub const DB_BYTES_PER_LEASE: f64 = 80.0;
    /// Resident memory per live lock key (index, value, mapped pages).
    pub const MEM_BYTES_PER_KEY: f64 = 1_000.0;
    /// Resident memory per revision kept until compaction.
    pub const MEM_BYTES_PER_REVISION: f64 = 260.0;
    /// Resident memory per lease (lessor maps, expiry heap).
    pub const MEM_BYTES_PER_LEASE: f64 = 1_300.0;
    /// Resident memory of an idle member.
    pub const MEM_BASE_BYTES: f64 = 25e6;
    /// etcd's default backend quota (`--quota-backend-bytes`): 2 GiB.
    pub const QUOTA_BYTES: f64 = 2_147_483_648.0;
    /// Where the defaults come from, printed with every plan.
    pub const SOURCE: &str = "etcd 3.4.23, one member on 2 cores, client on the same machine \
        (~9.8K txn acquires/s, ~12K keepalives/s; bytes per key, revision and lease measured \
        the same way); see docs/capacity.md";
}

/// Largest shard count the planner considers.
pub const MAX_SHARDS: u32 = 1_024;
/// Lock names hashed onto a ring to measure its imbalance.
const SAMPLE_NAMES: usize = 50_000;
/// Most locks the client SDK puts in one `renew-batch` (its `MAX_BATCH`,
/// the router's default `limits.max_batch`).
const MAX_BATCH: f64 = 1_000.0;

/// How clients renew their locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Renewal {
    /// One `renew-batch` per client per interval: one keepalive per session.
    Batch,
    /// One `renew` per lock, spread over the interval.
    Each,
}

/// The workload and limits to plan for.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    /// Locks held at the same moment, over all shards.
    pub locks: f64,
    /// Distinct clientIds holding them.
    pub clients: f64,
    /// Granted acquires per second (each lock is later released).
    pub acquires_per_sec: f64,
    /// Acquire attempts per second answered `acquired: false` (contention).
    pub refused_acquires_per_sec: f64,
    /// Lock TTL in seconds.
    pub ttl_secs: f64,
    /// Seconds between renewals of a lock [default: TTL / 3].
    pub renew_every_secs: Option<f64>,
    /// How clients renew.
    pub renewal: Renewal,
    /// Evaluate this many shards [default: the recommended number].
    pub shards: Option<u32>,
    /// Router replicas a client's acquires are spread over (each grants
    /// its own session leases).
    pub router_replicas: u32,
    /// Distinct TTLs one client uses (one session lease per TTL).
    pub ttls_per_client: u32,
    /// How long a clientId lives; each ends with a session revoke per shard.
    pub client_lifetime_secs: f64,
    /// The routers' `etcd.keepalive_coalesce_ms`.
    pub coalesce_ms: f64,
    /// The routers' `etcd.keepalive_below_pct`.
    pub keepalive_below_pct: f64,
    /// How long one lock-key cache barrier (a one-key `Put`) takes from
    /// send to answer, in milliseconds.
    pub barrier_latency_ms: f64,
    /// The routers' `etcd.barrier_spacing_ms`.
    pub barrier_spacing_ms: f64,
    /// The routers' `ring.vnodes`.
    pub vnodes: u32,
    /// Raft writes/s one shard sustains.
    pub max_raft_writes_per_sec: f64,
    /// Keepalives/s one shard's leader sustains.
    pub max_keepalives_per_sec: f64,
    /// Share of a shard's capacity the busiest shard may use.
    pub target_utilisation: f64,
    /// etcd's `--quota-backend-bytes`.
    pub quota_bytes: f64,
    /// etcd's periodic `--auto-compaction-retention`, in seconds.
    pub compaction_retention_secs: f64,
}

/// What one shard carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardLoad {
    pub locks: f64,
    pub leases: f64,
    /// Every raft write: acquire and release txns (an upper bound: group
    /// commit shares txns under load), session grants and revokes, and
    /// the renewals' barriers.
    pub raft_writes_per_sec: f64,
    pub keepalives_per_sec: f64,
    /// The part of `raft_writes_per_sec` that renewals cost: lock-key
    /// cache barriers, one per shard per router replica at a time.
    pub barrier_writes_per_sec: f64,
    /// Linearizable read-only txns (no raft write): one per refused acquire
    /// of a held name, read first. Renewals read nothing while the
    /// lock-key cache vouches.
    pub reads_per_sec: f64,
    /// `raft writes / limit + keepalives / limit`: both load the leader's CPU.
    pub utilisation: f64,
    pub db_bytes: f64,
    pub memory_bytes: f64,
}

/// A design (lockrouter, or one lease per lock) on a number of shards.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Layout {
    pub shards: u32,
    /// Busiest shard's share of names over the mean share, on this ring.
    pub imbalance: f64,
    pub busiest_shard: ShardLoad,
    pub all_shards: ShardLoad,
    /// Workload growth the layout takes before the busiest shard reaches
    /// the target utilisation, and before it saturates.
    pub growth_to_target: f64,
    pub growth_to_saturation: f64,
}

/// What `lockrouter plan` prints.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    pub workload: Workload,
    pub calibration_source: &'static str,
    pub recommended_shards: u32,
    /// lockrouter on `--shards`, or on the recommended count.
    pub lockrouter: Layout,
    /// One lease per lock (grant + txn, revoke on release), on as many
    /// shards as it needs.
    pub one_lease_per_lock: Layout,
    /// Keepalives/s and raft writes/s of one lease per lock over lockrouter's.
    pub keepalive_saving: f64,
    pub raft_write_saving: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Design {
    Coalesced,
    LeasePerLock,
}

impl Workload {
    pub fn renew_every(&self) -> f64 {
        self.renew_every_secs.unwrap_or(self.ttl_secs / 3.0)
    }

    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        let nonneg = [
            ("--locks", self.locks),
            ("--acquires-per-sec", self.acquires_per_sec),
            ("--refused-acquires-per-sec", self.refused_acquires_per_sec),
            ("--barrier-latency-ms", self.barrier_latency_ms),
            ("--barrier-spacing-ms", self.barrier_spacing_ms),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be a number >= 0"));
            }
        }
        let positive = [
            ("--clients", self.clients),
            ("--renew-every-secs", self.renew_every()),
            ("--client-lifetime-secs", self.client_lifetime_secs),
            ("--max-raft-writes-per-sec", self.max_raft_writes_per_sec),
            ("--max-keepalives-per-sec", self.max_keepalives_per_sec),
            ("--quota-bytes", self.quota_bytes),
            (
                "--compaction-retention-secs",
                self.compaction_retention_secs,
            ),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be a number > 0"));
            }
        }
        if !(self.ttl_secs >= 2.0 && self.ttl_secs <= 3_600.0) {
            return Err("--ttl-secs must be 2 to 3600 (etcd's minimum lease TTL is 2 s)".into());
        }
        if self.renew_every() >= self.ttl_secs {
            return Err("--renew-every-secs must be shorter than the TTL".into());
        }
        if !(self.coalesce_ms >= 0.0 && self.coalesce_ms.is_finite()) {
            return Err("--coalesce-ms must be >= 0".into());
        }
        if !(40.0..=100.0).contains(&self.keepalive_below_pct) {
            return Err("--keepalive-below-pct must be 40 to 100 (the router's own range)".into());
        }
        if !(self.target_utilisation > 0.0 && self.target_utilisation <= 1.0) {
            return Err("--target-utilisation must be in (0, 1]".into());
        }
        if self.router_replicas == 0 || self.ttls_per_client == 0 || self.vnodes == 0 {
            return Err("--router-replicas, --ttls-per-client and --vnodes must be >= 1".into());
        }
        if self.shards.is_some_and(|s| s == 0 || s > MAX_SHARDS) {
            return Err(format!("--shards must be 1 to {MAX_SHARDS}"));
        }
        Ok(())
    }

    /// The load on a shard that receives `share` of all lock names.
    fn shard_load(&self, design: Design, share: f64) -> ShardLoad {
        let locks = self.locks * share;
        let acquires = self.acquires_per_sec * share;
        let refused = self.refused_acquires_per_sec * share;
        let renew = self.renew_every();
        // Renewals and acquires send a session lease no keepalive until less
        // than `keepalive_below_pct` of its TTL is left, nor within the
        // coalescing window of the last (capped at a tenth of the TTL).
        let window = (self.coalesce_ms / 1_000.0).min(self.ttl_secs / 10.0);
        let renewal_window = window.max(self.ttl_secs * (1.0 - self.keepalive_below_pct / 100.0));
        let (leases, writes, keepalives, barriers, reads) = match design {
            Design::LeasePerLock => (
                locks,
                3.0 * (acquires + refused), // grant + txn + revoke
                locks / renew,
                0.0,
                0.0,
            ),
            Design::Coalesced => {
                // Refused acquires of held names are answered from a
                // read-only txn: no raft write, no keepalive of the
                // caller's session.
                let holding = self.sessions(share);
                // A grant and a revoke per session over its client's life.
                let churn = 2.0 * holding / self.client_lifetime_secs;
                // A session its renewals keep alive gets a keepalive at the
                // first renewal past the renewal window, and its acquires
                // add none.
                let per_session = if holding > 0.0 {
                    match self.renewal {
                        Renewal::Batch => 1.0 / (renew * ((renewal_window / renew).floor() + 1.0)),
                        Renewal::Each => dead_time(locks / holding / renew, renewal_window),
                    }
                } else {
                    0.0
                };
                // The other session slots hold no lock: only their
                // acquires keep them alive.
                let slots = self.clients * self.slots_per_client();
                let idle = (slots - holding).max(0.0);
                let by_acquires = kept_by_acquires(acquires / slots, renewal_window, self.ttl_secs);
                let barriers = self.barrier_writes(share);
                (
                    holding + idle * by_acquires.alive,
                    // Acquire txn + release txn per lock: an upper bound,
                    // since group commit packs concurrent ones into one txn.
                    2.0 * acquires + churn + 2.0 * idle * by_acquires.grants + barriers,
                    holding * per_session + idle * by_acquires.keepalives,
                    barriers,
                    refused,
                )
            }
        };
        // A lock's put and its delete are revisions, and so is every
        // barrier; periodic compaction keeps up to two retention periods
        // of them.
        let revisions = (2.0 * acquires + barriers) * 2.0 * self.compaction_retention_secs;
        use calibration as c;
        ShardLoad {
            locks,
            leases,
            raft_writes_per_sec: writes,
            keepalives_per_sec: keepalives,
            barrier_writes_per_sec: barriers,
            reads_per_sec: reads,
            utilisation: writes / self.max_raft_writes_per_sec
                + keepalives / self.max_keepalives_per_sec,
            db_bytes: locks * c::DB_BYTES_PER_KEY
                + revisions * c::DB_BYTES_PER_REVISION
                + leases * c::DB_BYTES_PER_LEASE,
            memory_bytes: c::MEM_BASE_BYTES
                + locks * c::MEM_BYTES_PER_KEY
                + revisions * c::MEM_BYTES_PER_REVISION
                + leases * c::MEM_BYTES_PER_LEASE,
        }
    }

    /// Renewal requests per second that touch a shard with `share` of the
    /// names, over all router replicas. A `renew-batch` (up to
    /// [`MAX_BATCH`] locks) touches every shard one of its locks is on.
    fn renew_requests(&self, share: f64) -> f64 {
        let renew = self.renew_every();
        match self.renewal {
            Renewal::Each => self.locks * share / renew,
            Renewal::Batch => {
                let per_client = self.locks / self.clients;
                let batches = (per_client / MAX_BATCH).ceil().max(1.0);
                let per_batch = per_client / batches;
                self.clients * batches * (1.0 - (1.0 - share).powf(per_batch)) / renew
            }
        }
    }

    /// Barrier writes/s on a shard with `share` of the names: each router
    /// replica keeps its own cache and writes one barrier at a time per
    /// shard, at least `barrier_spacing_ms` after the previous one, shared by
    /// every renewal that arrived meanwhile. Renewals are spread evenly
    /// over the replicas.
    fn barrier_writes(&self, share: f64) -> f64 {
        let replicas = f64::from(self.router_replicas);
        let per_replica = self.renew_requests(share) / replicas;
        let spacing = self.barrier_spacing_ms / 1_000.0;
        let cycle = (self.barrier_latency_ms / 1_000.0).max(spacing);
        replicas * one_in_flight(per_replica, cycle)
    }

    /// Expected session leases on a shard with `share` of the names: each of
    /// a client's locks rides on one of `replicas × ttls` sessions per shard
    /// it lands on, so a client with few locks touches few sessions.
    fn sessions(&self, share: f64) -> f64 {
        let slots = self.slots_per_client();
        let per_client = self.locks / self.clients;
        self.clients * slots * (1.0 - (1.0 - share / slots).powf(per_client))
    }

    /// Session leases a client may have on one shard: one per (router
    /// replica, TTL).
    fn slots_per_client(&self) -> f64 {
        f64::from(self.router_replicas) * f64::from(self.ttls_per_client)
    }

    fn layout(&self, design: Design, shards: u32, imbalance: f64) -> Layout {
        let n = f64::from(shards);
        let busiest = self.shard_load(design, imbalance / n);
        let mean = self.shard_load(design, 1.0 / n);
        let all = ShardLoad {
            locks: mean.locks * n,
            leases: mean.leases * n,
            raft_writes_per_sec: mean.raft_writes_per_sec * n,
            keepalives_per_sec: mean.keepalives_per_sec * n,
            barrier_writes_per_sec: mean.barrier_writes_per_sec * n,
            reads_per_sec: mean.reads_per_sec * n,
            utilisation: mean.utilisation * n,
            db_bytes: mean.db_bytes * n,
            memory_bytes: mean.memory_bytes * n,
        };
        let busiest_use = busiest.utilisation.max(busiest.db_bytes / self.quota_bytes);
        Layout {
            shards,
            imbalance,
            busiest_shard: busiest,
            all_shards: all,
            growth_to_target: self.target_utilisation / busiest_use,
            growth_to_saturation: 1.0 / busiest_use,
        }
    }

    /// The fewest shards whose busiest shard stays within the target
    /// utilisation and the same share of the backend quota.
    fn fewest_shards(&self, design: Design, rings: &mut RingCache) -> Option<u32> {
        // Total load never shrinks as shards are added (sessions and the
        // renewal requests that touch a shard only multiply, and splitting
        // requests over more caches never shares barriers better), so one
        // shard's load over the target is a lower bound.
        let one = self.shard_load(design, 1.0);
        let floor = (one.utilisation / self.target_utilisation)
            .max(one.db_bytes / (self.target_utilisation * self.quota_bytes))
            .ceil()
            .clamp(1.0, f64::from(MAX_SHARDS)) as u32;
        (floor..=MAX_SHARDS).find(|&s| {
            let l = self.layout(design, s, rings.imbalance(s));
            l.growth_to_target >= 1.0
        })
    }
}

/// Keepalives/s for demand `rate` per second on one lease when a keepalive
/// covers every renewal in the `window` after it (a non-paralysable dead
/// time: `r / (1 + r·w)` for evenly random renewals).
fn dead_time(rate: f64, window: f64) -> f64 {
    rate / (1.0 + rate * window)
}

/// A session slot that holds no lock, kept alive by its acquires alone.
#[derive(Debug, Clone, Copy, PartialEq)]
struct KeptByAcquires {
    /// Share of the time its session lease is alive.
    alive: f64,
    /// Keepalives/s.
    keepalives: f64,
    /// New session leases/s, each also revoked by etcd when it runs out.
    grants: f64,
}

/// What a session slot that holds no lock costs when acquires on it arrive
/// at random at `rate` per second, with `window` the renewal window
/// (`max(w, T·(1 − p/100))`) and `ttl` the lease's TTL. After a keepalive
/// or a grant, acquires send nothing for `window`; the first one after it
/// sends a keepalive if it comes before the lease ends (`ttl` after it),
/// and otherwise the session has lapsed and it grants a new one. A cycle
/// lasts `window + 1/rate` on average and ends in a grant with probability
/// `e^(−rate·(ttl − window))`. The lease is alive while an acquire came
/// within about a TTL: `1 − e^(−rate·ttl)` of the time.
fn kept_by_acquires(rate: f64, window: f64, ttl: f64) -> KeptByAcquires {
    if rate <= 0.0 {
        return KeptByAcquires {
            alive: 0.0,
            keepalives: 0.0,
            grants: 0.0,
        };
    }
    let cycles = dead_time(rate, window);
    let lapse = (-rate * (ttl - window).max(0.0)).exp();
    KeptByAcquires {
        alive: 1.0 - (-rate * ttl).exp(),
        keepalives: cycles * (1.0 - lapse),
        grants: cycles * lapse,
    }
}

/// Writes/s for requests arriving at random at `rate` per second when one
/// write is in flight at a time, each taking `latency` seconds, and a write
/// serves every request that arrived before it was sent: a request that
/// arrives during a write waits for the next one, which starts as soon as
/// the current one is answered. Each write is followed by another at once
/// with probability `1 − e^(−r·b)` and otherwise by an idle wait of `1/r`,
/// so writes/s is `r / (r·b + e^(−r·b))`: `r` when requests are sparse,
/// `1/b` when they always queue, and never more than `r`. (Not
/// [`dead_time`]: a request during a write is not covered by it.)
fn one_in_flight(rate: f64, latency: f64) -> f64 {
    if rate <= 0.0 {
        return 0.0;
    }
    let x = rate * latency;
    rate / (x + (-x).exp())
}

/// Imbalance of real rings (shards named a, b, c, ...), computed once each.
struct RingCache {
    vnodes: u32,
    known: Vec<(u32, f64)>,
}

impl RingCache {
    fn imbalance(&mut self, shards: u32) -> f64 {
        if let Some(&(_, v)) = self.known.iter().find(|(s, _)| *s == shards) {
            return v;
        }
        let v = ring_imbalance(shards, self.vnodes);
        self.known.push((shards, v));
        v
    }
}

/// The busiest shard's share of sample names over the mean share.
pub fn ring_imbalance(shards: u32, vnodes: u32) -> f64 {
    if shards <= 1 {
        return 1.0;
    }
    let settings: Vec<ShardSettings> = (0..shards)
        .map(|i| ShardSettings {
            name: shard_name(i),
            endpoints: vec!["http://127.0.0.1:2379".into()],
            weight: 1,
            ..ShardSettings::default()
        })
        .collect();
    let ring = Ring::new(&settings, vnodes);
    let mut counts = vec![0usize; shards as usize];
    for i in 0..SAMPLE_NAMES {
        counts[ring.shard_index(&format!("lock-{i}"))] += 1;
    }
    let max = counts.iter().copied().max().unwrap_or(0) as f64;
    max / (SAMPLE_NAMES as f64 / f64::from(shards))
}

/// a, b, ..., z, aa, ab, ... like the example configs.
fn shard_name(mut i: u32) -> String {
    let mut name = Vec::new();
    loop {
        name.push(b'a' + (i % 26) as u8);
        if i < 26 {
            break;
        }
        i = i / 26 - 1;
    }
    name.reverse();
    String::from_utf8(name).expect("ASCII letters")
}

/// Runs the model.
pub fn plan(args: &Workload) -> Result<Plan, String> {
    args.validate()?;
    let mut rings = RingCache {
        vnodes: args.vnodes,
        known: Vec::new(),
    };
    let too_big = |what: &str| {
        format!("{what} would need more than {MAX_SHARDS} shards at these limits; check the inputs")
    };
    let recommended = args
        .fewest_shards(Design::Coalesced, &mut rings)
        .ok_or_else(|| too_big("lockrouter"))?;
    let naive_shards = args
        .fewest_shards(Design::LeasePerLock, &mut rings)
        .ok_or_else(|| too_big("one lease per lock"))?;
    let shards = args.shards.unwrap_or(recommended);
    let lockrouter = args.layout(Design::Coalesced, shards, rings.imbalance(shards));
    let naive = args.layout(
        Design::LeasePerLock,
        naive_shards,
        rings.imbalance(naive_shards),
    );
    let same = args.layout(Design::LeasePerLock, shards, rings.imbalance(shards));
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 1.0 };
    let mut workload = args.clone();
    workload.renew_every_secs = Some(args.renew_every());
    Ok(Plan {
        workload,
        calibration_source: calibration::SOURCE,
        recommended_shards: recommended,
        keepalive_saving: ratio(
            same.all_shards.keepalives_per_sec,
            lockrouter.all_shards.keepalives_per_sec,
        ),
        raft_write_saving: ratio(
            same.all_shards.raft_writes_per_sec,
            lockrouter.all_shards.raft_writes_per_sec,
        ),
        lockrouter,
        one_lease_per_lock: naive,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::plan::PlanArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: PlanArgs,
    }

    /// The 1M-lock / 10K-acquires/s case, with `extra` flags added or
    /// replacing its three required ones.
    fn args(extra: &[&str]) -> Workload {
        let mut argv = vec!["plan"];
        for (flag, value) in [
            ("--locks", "1000000"),
            ("--clients", "10000"),
            ("--acquires-per-sec", "10000"),
        ] {
            if !extra.contains(&flag) {
                argv.extend_from_slice(&[flag, value]);
            }
        }
        argv.extend_from_slice(extra);
        Workload::from(&Cli::parse_from(argv).args)
    }

    #[test]
    fn one_lease_per_lock_pays_a_keepalive_per_lock() {
        let a = args(&["--shards", "1", "--router-replicas", "1"]);
        let naive = a.shard_load(Design::LeasePerLock, 1.0);
        assert_eq!(naive.keepalives_per_sec, 100_000.0); // 1M locks / 10 s
        assert_eq!(naive.raft_writes_per_sec, 30_000.0);
        let ours = a.shard_load(Design::Coalesced, 1.0);
        // 10K clients with 100 locks each on one shard: 10K sessions.
        assert!((ours.leases - 10_000.0).abs() < 1.0, "{ours:?}");
        // Acquire and release txns, session churn, and the barriers.
        let txns = ours.raft_writes_per_sec - ours.barrier_writes_per_sec;
        assert!((20_000.0..20_011.0).contains(&txns), "{ours:?}");
    }

    #[test]
    fn barriers_never_exceed_renew_requests() {
        for renewal in ["batch", "each"] {
            for replicas in ["1", "2", "8"] {
                for latency in ["0", "1", "5", "50"] {
                    let a = args(&[
                        "--renewal",
                        renewal,
                        "--router-replicas",
                        replicas,
                        "--barrier-latency-ms",
                        latency,
                    ]);
                    for share in [1.0, 0.3, 0.01, 1e-6] {
                        let requests = a.renew_requests(share);
                        let barriers = a.barrier_writes(share);
                        assert!(barriers > 0.0, "{renewal} {replicas} {latency} {share}");
                        assert!(
                            barriers <= requests * (1.0 + 1e-12),
                            "{barriers} > {requests}: {renewal} {replicas} {latency} {share}"
                        );
                        // At most one barrier in flight per replica, and
                        // at most one per spacing.
                        let spacing = a.barrier_spacing_ms / 1_000.0;
                        let cycle = (a.barrier_latency_ms / 1_000.0).max(spacing);
                        let most = a.router_replicas as f64 / cycle;
                        assert!(barriers <= most * (1.0 + 1e-12), "{barriers} > {most}");
                    }
                }
            }
        }
        // Sparse requests each write their own barrier; back-to-back ones
        // one per latency.
        assert!((one_in_flight(1.0, 0.005) - 1.0).abs() < 0.01);
        assert!((one_in_flight(1e6, 0.005) - 200.0).abs() < 0.01);
        assert_eq!(one_in_flight(0.0, 0.005), 0.0);
        assert_eq!(one_in_flight(7.0, 0.0), 7.0);
    }

    #[test]
    fn refused_acquires_cost_reads_not_raft_writes() {
        let calm = args(&[]);
        let contended = args(&["--refused-acquires-per-sec", "50000"]);
        for share in [1.0, 0.2] {
            let (c, h) = (
                calm.shard_load(Design::Coalesced, share),
                contended.shard_load(Design::Coalesced, share),
            );
            assert_eq!(h.raft_writes_per_sec, c.raft_writes_per_sec);
            assert_eq!(h.keepalives_per_sec, c.keepalives_per_sec);
            assert_eq!(h.utilisation, c.utilisation);
            assert_eq!(c.reads_per_sec, 0.0);
            assert!((h.reads_per_sec - 50_000.0 * share).abs() < 1e-6);
        }
        // One lease per lock still pays grant, txn and revoke for them.
        let naive = contended.shard_load(Design::LeasePerLock, 1.0);
        assert_eq!(naive.raft_writes_per_sec, 3.0 * 60_000.0);
    }

    #[test]
    fn batch_renewals_cost_per_client_not_per_lock() {
        // 1M locks on 10K clients, one shard, one replica: renewals are 10K
        // renew-batches per 10 s, so keepalives are one per session per
        // round plus the acquires', and barriers at most one per batch.
        let a = args(&["--router-replicas", "1"]);
        let l = a.shard_load(Design::Coalesced, 1.0);
        assert_eq!(a.renew_requests(1.0), 1_000.0);
        assert!(l.barrier_writes_per_sec <= 1_000.0, "{l:?}");
        assert_eq!(l.reads_per_sec, 0.0);
        let acquires = 10_000.0;
        assert!(l.keepalives_per_sec <= 10_000.0 / 10.0 + acquires, "{l:?}");
        // Ten times the locks on the same clients: the renewal cost does
        // not move (it would be 100K reads/s, then 1M, one per lock).
        let more = args(&["--router-replicas", "1", "--locks", "10000000"]);
        let m = more.shard_load(Design::Coalesced, 1.0);
        assert_eq!(m.barrier_writes_per_sec, l.barrier_writes_per_sec);
        assert_eq!(m.keepalives_per_sec, l.keepalives_per_sec);
        // Past MAX_BATCH locks a client sends several batches a round.
        let huge = args(&["--router-replicas", "1", "--clients", "100"]);
        assert_eq!(huge.renew_requests(1.0), 100.0 * 10.0 / 10.0);
        // One renew per lock is O(locks) requests, but barriers stay
        // bounded by one in flight per replica.
        let each = args(&["--router-replicas", "1", "--renewal", "each"]);
        assert_eq!(each.renew_requests(1.0), 100_000.0);
        assert!(each.barrier_writes(1.0) <= 200.0);
    }

    #[test]
    fn sessions_renewed_lock_by_lock_get_a_keepalive_per_renewal_window() {
        // 1M locks on 10K clients, one shard, one replica: 100 locks per
        // session, one `renew` each every 10 s, so a renewal every 0.1 s;
        // the first past the 15 s window sends the keepalive.
        let each = args(&["--router-replicas", "1", "--renewal", "each"]);
        let l = each.shard_load(Design::Coalesced, 1.0);
        let per_session = l.keepalives_per_sec / 10_000.0;
        let expected = 10.0 / (1.0 + 10.0 * 15.0);
        assert!(
            (per_session - expected).abs() < 1e-6,
            "{per_session} != {expected}"
        );
    }

    #[test]
    fn sessions_never_exceed_locks() {
        let a = args(&["--clients", "1000000", "--router-replicas", "4"]);
        for share in [1.0, 0.5, 0.1] {
            assert!(a.sessions(share) <= a.locks * share + 1e-6);
        }
    }

    #[test]
    fn sessions_that_hold_no_lock_are_kept_alive_by_their_acquires() {
        // `uncontested` (docs/capacity.md, "Keepalives/s"): each lock
        // released at once (a few dozen held at any moment), 10,000
        // clientIds on 3 shards through one replica, TTL 30 s; measured
        // 6,772 acquires/s and 0.21 keepalives per acquire.
        let measured = [
            "--locks",
            "30",
            "--acquires-per-sec",
            "6772",
            "--router-replicas",
            "1",
        ];
        let a = args(&measured);
        let l = a.shard_load(Design::Coalesced, 1.0 / 3.0);
        let per_acquire = l.keepalives_per_sec / (6_772.0 / 3.0);
        assert!((0.19..0.25).contains(&per_acquire), "{per_acquire} {l:?}");
        // Nearly every client's session on the shard is alive.
        assert!((9_000.0..10_000.0).contains(&l.leases), "{l:?}");
        // Fewer keepalives with a lower `keepalive_below_pct`, more with 100.
        let mut lower = measured.to_vec();
        lower.extend(["--keepalive-below-pct", "40"]);
        let mut every = measured.to_vec();
        every.extend(["--keepalive-below-pct", "100"]);
        let kept = |argv: &[&str]| {
            args(argv)
                .shard_load(Design::Coalesced, 1.0 / 3.0)
                .keepalives_per_sec
        };
        assert!(kept(&lower) < l.keepalives_per_sec);
        assert!(kept(&every) > 3.0 * l.keepalives_per_sec);

        // A client that acquires on a shard far less often than once a TTL
        // finds its session lapsed every time: a grant and a revoke per
        // acquire, no keepalive.
        let rare = kept_by_acquires(1e-4, 15.0, 30.0);
        assert!(rare.keepalives < 1e-4 * 0.01, "{rare:?}");
        assert!((rare.grants / 1e-4 - 1.0).abs() < 0.01, "{rare:?}");
        assert!(rare.alive < 0.01, "{rare:?}");
        let sparse = args(&[
            "--locks",
            "0",
            "--clients",
            "1000000",
            "--acquires-per-sec",
            "100",
            "--router-replicas",
            "1",
        ]);
        let s = sparse.shard_load(Design::Coalesced, 1.0);
        let txns = 2.0 * 100.0;
        assert!(
            (s.raft_writes_per_sec - txns - 2.0 * 100.0).abs() < 1.0,
            "{s:?}"
        );
        // One that acquires often sends one keepalive per renewal window
        // and never lapses.
        let busy = kept_by_acquires(100.0, 15.0, 30.0);
        assert!((busy.keepalives * 15.0 - 1.0).abs() < 0.01, "{busy:?}");
        assert!(busy.grants < 1e-9 && busy.alive > 0.999, "{busy:?}");
        // Every cycle ends in one or the other.
        for rate in [1e-3, 0.05, 0.3, 2.0] {
            let k = kept_by_acquires(rate, 15.0, 30.0);
            let cycles = rate / (1.0 + rate * 15.0);
            assert!((k.keepalives + k.grants - cycles).abs() < 1e-12, "{k:?}");
        }
        assert_eq!(kept_by_acquires(0.0, 15.0, 30.0).keepalives, 0.0);
    }

    #[test]
    fn recommendation_meets_the_target_and_one_fewer_does_not() {
        let p = plan(&args(&[])).unwrap();
        assert!(p.lockrouter.busiest_shard.utilisation <= 0.6);
        let a = args(&[]);
        let fewer = p.recommended_shards - 1;
        let l = a.layout(Design::Coalesced, fewer, ring_imbalance(fewer, 160));
        assert!(l.growth_to_target < 1.0);
        assert!(p.one_lease_per_lock.shards > p.recommended_shards);
        // Renewals' barriers are raft writes too, so the write saving is
        // smaller than the keepalive saving.
        assert!(p.keepalive_saving > 3.0 && p.raft_write_saving > 1.2);
    }

    #[test]
    fn rings_are_nearly_balanced() {
        assert_eq!(ring_imbalance(1, 160), 1.0);
        let i = ring_imbalance(6, 160);
        assert!(i > 1.0 && i < 1.3, "{i}");
        assert_eq!(shard_name(0), "a");
        assert_eq!(shard_name(25), "z");
        assert_eq!(shard_name(26), "aa");
    }

    #[test]
    fn bad_inputs_are_refused() {
        assert!(plan(&args(&["--ttl-secs", "1"])).is_err());
        assert!(plan(&args(&["--renew-every-secs", "40"])).is_err());
        assert!(plan(&args(&["--target-utilisation", "0"])).is_err());
        assert!(plan(&args(&["--clients", "0"])).is_err());
        assert!(plan(&args(&["--shards", "0"])).is_err());
        assert!(plan(&args(&["--barrier-latency-ms=-1"])).is_err());
    }
}
