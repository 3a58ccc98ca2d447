//! Metric names and the Prometheus recorder. Every series is labelled by
//! bounded values only (operation, outcome, shard, RPC, and principals' and
//! lockId keys' names from the config): never by lock name or client id,
//! so the number of series stays fixed however many locks exist.
//! `docs/metrics.md` lists them.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{LazyLock, OnceLock, RwLock};
use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Every `_seconds` histogram without a list of its own: fine where
/// latency objectives are set (a p99 of 10 ms is read between 7.5 and 15
/// ms, not 5 and 20), coarse beyond 100 ms.
const LATENCY_BUCKETS: &[f64] = &[
    0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
];
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];
/// `lockrouter_wait_seconds`: up to `limits.max_wait_ms`'s ceiling, 600 s.
const WAIT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// `lockrouter_hold_seconds`: from a quick critical section to an hour
/// (longer holds count in `+Inf`).
const HOLD_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
/// `process_*` series (resident memory, CPU seconds, open fds, ...).
static PROCESS: OnceLock<metrics_process::Collector> = OnceLock::new();

/// Samples the process series; called just before each scrape renders.
pub fn collect_process() {
    PROCESS
        .get_or_init(|| {
            let c = metrics_process::Collector::default();
            c.describe();
            c
        })
        .collect();
    // The runtime serving this scrape is the router's (`server.worker_threads`).
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        gauge!(RUNTIME_WORKERS).set(rt.metrics().num_workers() as f64);
    }
}

const RUNTIME_WORKERS: &str = "lockrouter_runtime_workers";

/// Installs the process-wide recorder once and returns its handle. Several
/// routers in one process (as in tests) share it.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_batch_size".into()), BATCH_BUCKETS)
                })
                // A full name wins over the `_seconds` suffix.
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(WAIT_SECONDS.into()), WAIT_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(HOLD_SECONDS.into()), HOLD_BUCKETS)
                })
                .expect("bucket lists are non-empty")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed by an embedding
            // program; then ours only renders what it was given.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            handle
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "lockrouter_requests_total",
        "API requests by operation and outcome"
    );
    describe_histogram!(
        "lockrouter_request_duration_seconds",
        Unit::Seconds,
        "API request latency by operation"
    );
    describe_counter!(
        "lockrouter_etcd_requests_total",
        "etcd RPCs by shard, RPC and outcome"
    );
    describe_histogram!(
        SHARD_REQUEST_SECONDS,
        Unit::Seconds,
        "acquire and renewal latency by shard, from the request's arrival to its answer"
    );
    describe_histogram!(
        "lockrouter_etcd_request_duration_seconds",
        Unit::Seconds,
        "etcd RPC latency by shard and RPC"
    );
    describe_gauge!(
        "lockrouter_requests_in_flight",
        "lock API requests in flight in this replica (bounded by server.max_in_flight)"
    );
    describe_counter!(
        "lockrouter_etcd_hedged_requests_total",
        "etcd requests that did not answer in time and went to other members too (reads, barriers), and keepalive streams reopened on another member after going silent"
    );
    describe_counter!(
        "lockrouter_grant_cutoffs_total",
        "grant txns that went unanswered: the grant cut-off moved past them (moved) or not (failed)"
    );
    describe_counter!(
        "lockrouter_keepalives_sent_total",
        "lease keepalives sent to etcd"
    );
    describe_counter!(
        "lockrouter_keepalive_stream_failovers_total",
        "keepalive main streams given up and reopened, by reason: silent (no answer for 150 ms), ended (broken or closed, as when a silent member's connection is dropped), overdue (an answer past the deadline)"
    );
    describe_counter!("lockrouter_acquires_total", "acquires by shard and outcome");
    describe_counter!(
        "lockrouter_lock_ids_opened_total",
        "lockIds opened by renew, renew-batch and release, by the key that sealed them"
    );
    describe_counter!(
        "lockrouter_quota_refusals_total",
        "acquires refused at a principal's max_held_locks or max_sessions"
    );
    describe_counter!(
        "lockrouter_principal_requests_total",
        "lock API requests by principal and operation"
    );
    describe_counter!(
        "lockrouter_config_reloads_total",
        "config reloads by outcome"
    );
    describe_gauge!(
        "lockrouter_migration_open",
        "1 while this router follows an open migration"
    );
    describe_counter!(
        "lockrouter_lease_renewals_total",
        "lease renewals asked for by acquires and lock renewals (before coalescing)"
    );
    describe_gauge!(
        "lockrouter_session_leases",
        "session leases cached by this router"
    );
    describe_counter!("lockrouter_session_grants_total", "session leases granted");
    describe_gauge!("lockrouter_shard_up", "1 while the shard answers, else 0");
    describe_gauge!(
        RUNTIME_WORKERS,
        "threads serving requests and etcd calls (server.worker_threads; 0 there: one per core)"
    );
    describe_gauge!(
        BUILD_INFO,
        "1, labelled with this replica's version (lockrouter --version)"
    );
    describe_gauge!(
        SHARD_STATE,
        "1 for the shard's state as /readyz reports it, 0 for every other state"
    );
    describe_gauge!("lockrouter_ring_epoch", "ring epoch recorded on the shard");
    describe_gauge!(
        "lockrouter_shard_ring_ok",
        "1 while the shard's recorded ring matches this router's ring"
    );
    describe_gauge!(
        "lockrouter_active_locks",
        "lock keys on the shard (all routers' locks), sampled every etcd.count_interval_ms"
    );
    describe_gauge!(
        "lockrouter_cache_vouching",
        "1 while this replica's lock-key cache of the shard may answer renewals, else 0"
    );
    describe_gauge!(
        "lockrouter_cache_lock_keys",
        "lock keys this replica's lock-key cache of the shard holds (0 while it does not vouch)"
    );
    describe_gauge!(
        "lockrouter_migration_moved_locks",
        "during a migration: locks of moved names still held on this previous shard"
    );
    describe_histogram!(
        "lockrouter_verify_batch_size",
        "lock keys checked per read-only verification txn"
    );
    describe_counter!(
        "lockrouter_cache_barriers_total",
        "barriers written so that renewals may trust the lock-key cache"
    );
    describe_histogram!(
        "lockrouter_cache_barrier_batch_size",
        "renewal checks (per shard and request) sharing one cache barrier"
    );
    describe_counter!(
        "lockrouter_commits_total",
        "group commits (one etcd txn each) of grants (kind=acquire) or releases (kind=release)"
    );
    describe_histogram!(
        "lockrouter_keepalive_burst_size",
        "keepalives a main keepalive stream's writer sent back to back in one burst (one HTTP/2 frame as a rule)"
    );
    describe_histogram!(
        "lockrouter_commit_batch_size",
        "grants or releases sharing one group commit"
    );
    describe_counter!(
        "lockrouter_acquire_reads_first_total",
        "acquires of names the lock-key cache showed held (or this router was granting or had just granted), read before any txn (answered=true: the read answered, no txn)"
    );
    describe_counter!(
        "lockrouter_renewal_checks_total",
        "lock renewals checked by the lock-key cache or by a read of etcd"
    );
    describe_counter!(
        "lockrouter_lock_delays_total",
        "lock-delays set for holders lost without releasing (their lease ended)"
    );
    describe_counter!(
        "lockrouter_force_releases_total",
        "locks an operator took from their holder (POST /admin/v1/locks/{name}/force-release)"
    );
    describe_gauge!(
        WAITERS,
        "waiting acquires (waitMs > 0) this replica holds now, by the shard of their name"
    );
    describe_histogram!(
        WAIT_SECONDS,
        Unit::Seconds,
        "how long waiting acquires that found their name held waited, by outcome"
    );
    describe_histogram!(
        HOLD_SECONDS,
        Unit::Seconds,
        "how long released locks were held, from grant to release"
    );
}

/// How often histogram samples are folded into their buckets when nobody
/// scrapes: the recorder keeps every sample until then.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Folds recorded histogram samples into buckets every `every` (the
/// router uses [`UPKEEP_EVERY`]), so memory stays flat with or without a
/// Prometheus scraping.
pub fn start_upkeep(handle: PrometheusHandle, every: Duration) -> crate::task::TaskGuard {
    let cancel = tokio_util::sync::CancellationToken::new();
    let stop = cancel.clone();
    let task = tokio::spawn(async move {
        let mut every = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = every.tick() => handle.run_upkeep(),
                _ = stop.cancelled() => return,
            }
        }
    });
    crate::task::TaskGuard::new(task, cancel)
}

/// A barrier of the lock-key cache was written for `renewals` waiting ones.
pub fn cache_barrier(shard: &str, renewals: usize) {
    counter!("lockrouter_cache_barriers_total", "shard" => shard.to_string()).increment(1);
    histogram!("lockrouter_cache_barrier_batch_size", "shard" => shard.to_string())
        .record(renewals as f64);
}

/// An acquire read its name before any txn; `answered`: the read answered
/// it (held, or waiting out a lock-delay).
pub fn acquire_read_first(shard: &str, answered: bool) {
    let answered = if answered { "true" } else { "false" };
    counter!("lockrouter_acquire_reads_first_total", "shard" => shard.to_string(), "answered" => answered)
        .increment(1);
}

/// An operator force-released a lock on `shard`.
pub fn force_release(shard: &str) {
    counter!("lockrouter_force_releases_total", "shard" => shard.to_string()).increment(1);
}

/// `n` lockIds opened under `key` (a key id, or `unsigned`): when an old
/// key's count stops growing, no lock still uses it (key rotation).
pub fn lock_ids_opened(key: &str, n: u64) {
    static OPENED: LazyLock<Handles<String, Counter>> = LazyLock::new(Handles::default);
    OPENED
        .get(
            key,
            || counter!("lockrouter_lock_ids_opened_total", "key" => key.to_string()),
        )
        .increment(n);
}

/// A lock API request by `principal` (bounded: principals come from the
/// config).
pub fn principal_request(principal: &str, op: &'static str) {
    counter!("lockrouter_principal_requests_total", "principal" => principal.to_string(), "op" => op)
        .increment(1);
}

/// An acquire refused at `principal`'s `quota` (`max_held_locks` or
/// `max_sessions`).
pub fn quota_refusal(principal: &str, quota: &'static str) {
    counter!("lockrouter_quota_refusals_total", "principal" => principal.to_string(), "quota" => quota)
        .increment(1);
}

const WAITERS: &str = "lockrouter_waiters";
const WAIT_SECONDS: &str = "lockrouter_wait_seconds";
const HOLD_SECONDS: &str = "lockrouter_hold_seconds";

/// A waiting acquire (`waitMs` > 0) that found its name held, from then
/// until it answers: counted in `lockrouter_waiters` while this value
/// lives, its wait recorded in `lockrouter_wait_seconds` when it is
/// dropped. The drop does both, so no way out of a wait (an answer, an
/// error, the request dropped when its client goes or its deadline
/// passes) leaves the gauge counted; the outcome is `error` unless
/// [`Waiting::ended`] named another.
pub struct Waiting {
    shard: String,
    since: std::time::Instant,
    outcome: &'static str,
}

impl Waiting {
    /// A wait on `shard` begins now.
    pub fn start(shard: &str) -> Self {
        gauge!(WAITERS, "shard" => shard.to_string()).increment(1.0);
        Self {
            shard: shard.to_string(),
            since: std::time::Instant::now(),
            outcome: "error",
        }
    }

    /// The wait ends with an answer: `acquired` or `not_acquired`.
    pub fn ended(&mut self, acquired: bool) {
        self.outcome = if acquired { "acquired" } else { "not_acquired" };
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let shard = std::mem::take(&mut self.shard);
        gauge!(WAITERS, "shard" => shard.clone()).decrement(1.0);
        histogram!(WAIT_SECONDS, "shard" => shard, "outcome" => self.outcome)
            .record(self.since.elapsed().as_secs_f64());
    }
}

/// A lost holder's name got its lock-delay.
pub fn lock_delay_set(shard: &str) {
    counter!("lockrouter_lock_delays_total", "shard" => shard.to_string()).increment(1);
}

/// Handles of one family of series, one per set of label values,
/// registered on first use and kept. Naming a series by its labels on every
/// call (allocating the shard label, building and hashing the key, the
/// registry's lookup) costs about 0.8 µs; a kept handle about 0.06 µs, and
/// the hot paths count several series per request.
struct Handles<K, H> {
    map: RwLock<HashMap<K, H>>,
}

impl<K, H> Default for Handles<K, H> {
    fn default() -> Self {
        Self {
            map: RwLock::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq, H: Clone> Handles<K, H> {
    /// The handle of `key`'s series, registered by `register` on first use.
    /// `key` may be borrowed (a `&str` for `String` keys).
    fn get<Q>(&self, key: &Q, register: impl FnOnce() -> H) -> H
    where
        Q: ?Sized + Hash + Eq + ToOwned<Owned = K>,
        K: std::borrow::Borrow<Q>,
    {
        if let Some(h) = self.map.read().expect("metric handles").get(key) {
            return h.clone();
        }
        let mut map = self.map.write().expect("metric handles");
        map.entry(key.to_owned()).or_insert_with(register).clone()
    }
}

#[derive(Default)]
struct RequestSeries {
    requests: Handles<(&'static str, &'static str), Counter>,
    seconds: Handles<&'static str, Histogram>,
}

static REQUESTS: LazyLock<RequestSeries> = LazyLock::new(RequestSeries::default);

static IN_FLIGHT: LazyLock<metrics::Gauge> =
    LazyLock::new(|| gauge!("lockrouter_requests_in_flight"));

/// Lock API requests in flight in this replica (see `server.max_in_flight`).
pub fn requests_in_flight(n: usize) {
    IN_FLIGHT.set(n as f64);
}

pub fn request(op: &'static str, outcome: &'static str, elapsed: Duration) {
    let r = &*REQUESTS;
    r.requests
        .get(
            &(op, outcome),
            || counter!("lockrouter_requests_total", "op" => op, "outcome" => outcome),
        )
        .increment(1);
    r.seconds
        .get(
            &op,
            || histogram!("lockrouter_request_duration_seconds", "op" => op),
        )
        .record(elapsed.as_secs_f64());
}

const SHARD_REQUEST_SECONDS: &str = "lockrouter_shard_request_duration_seconds";

/// The lock requests whose latency is kept per shard, in
/// `lockrouter_shard_request_duration_seconds`.
#[derive(Clone, Copy, Debug)]
pub enum ShardOp {
    Acquire,
    /// A renew, or a renew-batch's part on one shard.
    Renew,
}

/// A lock request's latency on one shard, from the instant it was given
/// (the request's arrival) until this value is dropped: however the
/// request ends (an answer, an error, dropped at its deadline), it is
/// recorded once, unless [`Latency::discard`]ed.
pub struct Latency {
    /// `None` once discarded.
    histogram: Option<Histogram>,
    since: std::time::Instant,
}

impl Latency {
    /// Not recorded: the request is not one the series counts.
    pub fn discard(mut self) {
        self.histogram = None;
    }
}

impl Drop for Latency {
    fn drop(&mut self) {
        if let Some(h) = self.histogram.take() {
            h.record(self.since.elapsed());
        }
    }
}

/// The series of one shard that are counted on every request, renewal or
/// etcd call, by handle (see [`Handles`]). Each shard's connection owns one.
#[derive(Default)]
pub struct ShardMetrics {
    shard: String,
    rpcs: Handles<(&'static str, &'static str), Counter>,
    rpc_seconds: Handles<&'static str, Histogram>,
    acquires: Handles<&'static str, Counter>,
    renewal_checks: Handles<&'static str, Counter>,
    hedges: Handles<&'static str, Counter>,
    stream_failovers: Handles<&'static str, Counter>,
    cutoffs: Handles<&'static str, Counter>,
    lease_renewals: OnceLock<Counter>,
    keepalives_sent: OnceLock<Counter>,
    hold_seconds: OnceLock<Histogram>,
    /// `lockrouter_commits_total` and `lockrouter_commit_batch_size`, by
    /// the batch's kind.
    commits: Handles<&'static str, (Counter, Histogram)>,
    /// `lockrouter_shard_request_duration_seconds`, by [`ShardOp`].
    acquire_seconds: OnceLock<Histogram>,
    renew_seconds: OnceLock<Histogram>,
}

impl ShardMetrics {
    pub fn new(shard: &str) -> Self {
        Self {
            shard: shard.to_string(),
            ..Self::default()
        }
    }

    /// An idempotent etcd call that did not answer within the hedge delay
    /// and went to other members too.
    pub fn hedged(&self, rpc: &'static str) {
        let shard = &self.shard;
        self.hedges
            .get(&rpc, || counter!("lockrouter_etcd_hedged_requests_total", "shard" => shard.clone(), "rpc" => rpc))
            .increment(1);
    }

    /// A keepalive stream that went silent and was reopened on another
    /// member.
    pub fn keepalive_stream_silent(&self) {
        let shard = &self.shard;
        self.hedges
            .get(&"LeaseKeepAlive", || counter!("lockrouter_etcd_hedged_requests_total", "shard" => shard.clone(), "rpc" => "LeaseKeepAlive"))
            .increment(1);
    }

    /// A grant txn that went unanswered: whether the grant cut-off was
    /// moved past it (`moved`) or could not be (`failed`).
    pub fn cutoff_moved(&self, moved: bool) {
        let outcome = if moved { "moved" } else { "failed" };
        let shard = &self.shard;
        self.cutoffs
            .get(&outcome, || counter!("lockrouter_grant_cutoffs_total", "shard" => shard.clone(), "outcome" => outcome))
            .increment(1);
    }

    /// A keepalive main stream given up, for `reason` (`silent`, `ended`,
    /// `overdue`), its keepalives in flight sent again on a fresh one.
    pub fn keepalive_stream_failover(&self, reason: &'static str) {
        let shard = &self.shard;
        self.stream_failovers
            .get(&reason, || counter!("lockrouter_keepalive_stream_failovers_total", "shard" => shard.clone(), "reason" => reason))
            .increment(1);
    }

    /// An etcd call's outcome and latency.
    pub fn etcd_rpc(&self, rpc: &'static str, outcome: &'static str, elapsed: Duration) {
        let shard = &self.shard;
        self.rpcs
            .get(&(rpc, outcome), || {
                counter!("lockrouter_etcd_requests_total", "shard" => shard.clone(), "rpc" => rpc, "outcome" => outcome)
            })
            .increment(1);
        self.rpc_seconds
            .get(&rpc, || {
                histogram!("lockrouter_etcd_request_duration_seconds", "shard" => shard.clone(), "rpc" => rpc)
            })
            .record(elapsed.as_secs_f64());
    }

    /// An acquire's outcome on this shard: acquired, not_acquired (held or
    /// queued), shard_unavailable, rate_limited or error.
    pub fn acquire(&self, outcome: &'static str) {
        let shard = &self.shard;
        self.acquires
            .get(&outcome, || {
                counter!("lockrouter_acquires_total", "shard" => shard.clone(), "outcome" => outcome)
            })
            .increment(1);
    }

    /// A lock request on this shard that arrived at `since`: its latency is
    /// recorded when the value returned is dropped.
    pub fn latency(&self, op: ShardOp, since: std::time::Instant) -> Latency {
        let (cell, label) = match op {
            ShardOp::Acquire => (&self.acquire_seconds, "acquire"),
            ShardOp::Renew => (&self.renew_seconds, "renew"),
        };
        let shard = &self.shard;
        let histogram = cell
            .get_or_init(
                || histogram!(SHARD_REQUEST_SECONDS, "shard" => shard.clone(), "op" => label),
            )
            .clone();
        Latency {
            histogram: Some(histogram),
            since,
        }
    }

    /// Renewal checks answered by the cache (`cache`) or by a read (`read`).
    pub fn renewal_check(&self, by: &'static str, n: usize) {
        let shard = &self.shard;
        self.renewal_checks
            .get(&by, || {
                counter!("lockrouter_renewal_checks_total", "shard" => shard.clone(), "by" => by)
            })
            .increment(n as u64);
    }

    /// Lease renewals asked of the keepalive machinery.
    pub fn lease_renewals(&self, n: u64) {
        let shard = &self.shard;
        self.lease_renewals
            .get_or_init(|| counter!("lockrouter_lease_renewals_total", "shard" => shard.clone()))
            .increment(n);
    }

    /// One keepalive sent to etcd.
    pub fn keepalive_sent(&self) {
        let shard = &self.shard;
        self.keepalives_sent
            .get_or_init(|| counter!("lockrouter_keepalives_sent_total", "shard" => shard.clone()))
            .increment(1);
    }

    /// A lock on this shard was released after being held `held`.
    pub fn lock_held(&self, held: Duration) {
        let shard = &self.shard;
        self.hold_seconds
            .get_or_init(|| histogram!(HOLD_SECONDS, "shard" => shard.clone()))
            .record(held.as_secs_f64());
    }

    /// A group commit of `n` grants or releases (`kind`) went to etcd.
    pub fn commit_batch(&self, kind: &'static str, n: usize) {
        let shard = &self.shard;
        let (commits, sizes) = self.commits.get(&kind, || {
            (
                counter!("lockrouter_commits_total", "shard" => shard.clone(), "kind" => kind),
                histogram!("lockrouter_commit_batch_size", "shard" => shard.clone(), "kind" => kind),
            )
        });
        commits.increment(1);
        sizes.record(n as f64);
    }
}

/// A config reload: reloaded, refused (try again later) or invalid.
pub fn config_reload(outcome: &'static str) {
    counter!("lockrouter_config_reloads_total", "outcome" => outcome).increment(1);
}

/// 1 while this router follows an open migration.
pub fn migration_open(open: bool) {
    gauge!("lockrouter_migration_open").set(if open { 1.0 } else { 0.0 });
}

/// Main keepalive stream `stream` of a shard (0 up to
/// `etcd.keepalive_streams`) had its writer hand `n` keepalives to it back
/// to back (one HTTP/2 frame, as a rule).
pub fn keepalive_burst(shard: &str, stream: usize, n: usize) {
    histogram!(
        "lockrouter_keepalive_burst_size",
        "shard" => shard.to_string(),
        "stream" => stream.to_string()
    )
    .record(n as f64);
}

pub fn session_leases(shard: &str, n: usize) {
    gauge!("lockrouter_session_leases", "shard" => shard.to_string()).set(n as f64);
}

pub fn session_granted(shard: &str) {
    counter!("lockrouter_session_grants_total", "shard" => shard.to_string()).increment(1);
}

/// Spare session leases: `granted` ahead of need, `used` by a new session,
/// `expired` (dropped unused: too old, or flushed; etcd lets them lapse).
pub fn spare_leases(shard: &str, event: &'static str, n: usize) {
    if n > 0 {
        counter!("lockrouter_spare_leases_total", "shard" => shard.to_string(), "event" => event)
            .increment(n as u64);
    }
}

/// A connection to a shard's member: `made`, `failed` (could not be
/// made: refused, unreachable, TLS, timed out) or `lost` (closed, or its
/// pings went unanswered).
pub fn etcd_connection(shard: &str, member: &str, event: &'static str) {
    counter!("lockrouter_etcd_connections_total", "shard" => shard.to_string(), "member" => member.to_string(), "event" => event)
        .increment(1);
}

pub fn shard_up(shard: &str, up: bool) {
    gauge!("lockrouter_shard_up", "shard" => shard.to_string()).set(if up { 1.0 } else { 0.0 });
}

const BUILD_INFO: &str = "lockrouter_build_info";
const SHARD_STATE: &str = "lockrouter_shard_state";

/// Sets `lockrouter_shard_state` from the ring's shard states (`/readyz`'s
/// names, each one of `all`), just before a scrape renders, so the series
/// say what `/readyz` would say then. A shard that left the ring since the
/// last scrape gets 0 for every state: its series stay in the recorder,
/// and a 1 left on them would claim a state nobody sees any more.
pub fn shard_states(states: &[(String, &'static str)], all: &[&'static str]) {
    static SHOWN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut shown = SHOWN.lock().expect("shard state names");
    for gone in shown
        .iter()
        .filter(|n| !states.iter().any(|(s, _)| s == *n))
    {
        for state in all {
            gauge!(SHARD_STATE, "shard" => gone.clone(), "state" => *state).set(0.0);
        }
    }
    for (shard, now) in states {
        for state in all {
            let value = if state == now { 1.0 } else { 0.0 };
            gauge!(SHARD_STATE, "shard" => shard.clone(), "state" => *state).set(value);
        }
    }
    *shown = states.iter().map(|(s, _)| s.clone()).collect();
}

pub fn ring_state(shard: &str, epoch: u64, ok: bool) {
    gauge!("lockrouter_ring_epoch", "shard" => shard.to_string()).set(epoch as f64);
    gauge!("lockrouter_shard_ring_ok", "shard" => shard.to_string()).set(if ok {
        1.0
    } else {
        0.0
    });
}

/// The shard may (1) or may not (0) grant under this router's ring.
pub fn ring_ok(shard: &str, ok: bool) {
    gauge!("lockrouter_shard_ring_ok", "shard" => shard.to_string()).set(if ok {
        1.0
    } else {
        0.0
    });
}

pub fn migration_moved_held(shard: &str, n: i64) {
    gauge!("lockrouter_migration_moved_locks", "shard" => shard.to_string()).set(n as f64);
}

pub fn active_locks(shard: &str, n: i64) {
    gauge!("lockrouter_active_locks", "shard" => shard.to_string()).set(n as f64);
}

/// The lock-key cache's state: `Some(keys)` while it vouches.
pub fn cache_state(shard: &str, keys: Option<usize>) {
    let vouching = if keys.is_some() { 1.0 } else { 0.0 };
    gauge!("lockrouter_cache_vouching", "shard" => shard.to_string()).set(vouching);
    gauge!("lockrouter_cache_lock_keys", "shard" => shard.to_string())
        .set(keys.unwrap_or(0) as f64);
}

pub fn verify_batch(shard: &str, size: usize) {
    histogram!("lockrouter_verify_batch_size", "shard" => shard.to_string()).record(size as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident memory of this process, in KiB.
    fn rss_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/self/status")
    }

    async fn record(n: usize) {
        for chunk in 0..n / 10_000 {
            for i in 0..10_000 {
                histogram!("lockrouter_test_upkeep_seconds").record((chunk + i) as f64 * 1e-6);
            }
            tokio::task::yield_now().await;
        }
        // More than one upkeep interval, so the last samples are folded too.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    use crate::placement::topology::ShardState;

    #[test]
    fn latencies_near_a_ten_millisecond_objective_fall_in_buckets_of_their_own() {
        let handle = install();
        let name = "lockrouter_test_objective_seconds";
        for ms in [7.0, 9.0, 12.0] {
            histogram!(name).record(ms / 1000.0);
        }
        let text = handle.render();
        let count = |le: &str| {
            let series = format!("{name}_bucket{{le=\"{le}\"}} ");
            let line = text.lines().find(|l| l.starts_with(&series));
            line.and_then(|l| l[series.len()..].trim().parse::<u64>().ok())
        };
        assert_eq!(count("0.005"), Some(0), "{text}");
        assert_eq!(count("0.0075"), Some(1));
        assert_eq!(count("0.01"), Some(2));
        assert_eq!(count("0.015"), Some(3));
    }

    #[test]
    fn shard_state_labels_are_the_states_readyz_names() {
        for state in ShardState::ALL {
            assert_eq!(serde_json::to_value(state).unwrap(), state.as_str());
        }
    }

    #[test]
    fn each_shard_has_one_state_and_a_shard_that_left_has_none() {
        let handle = install();
        let (kept, left) = ("metrics-test-kept", "metrics-test-left");
        let all = ShardState::ALL.map(ShardState::as_str);
        shard_states(&[(kept.into(), "up"), (left.into(), "unreachable")], &all);
        shard_states(&[(kept.into(), "migrating")], &all);
        let text = handle.render();
        let value = |shard: &str, state: &str| {
            let series = format!("{SHARD_STATE}{{shard=\"{shard}\",state=\"{state}\"}} ");
            let line = text.lines().find(|l| l.starts_with(&series));
            line.and_then(|l| l[series.len()..].trim().parse::<f64>().ok())
        };
        assert_eq!(value(kept, "migrating"), Some(1.0), "{text}");
        assert_eq!(value(kept, "up"), Some(0.0));
        for state in ShardState::ALL {
            assert_eq!(value(left, state.as_str()), Some(0.0), "{state:?}");
        }
        let version = format!(
            "{BUILD_INFO}{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.lines().any(|l| l == version), "{text}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn histogram_samples_do_not_pile_up_when_nobody_scrapes() {
        let handle = install();
        let _upkeep = start_upkeep(handle, Duration::from_millis(50));
        record(2_000_000).await;
        let before = rss_kib();
        record(2_000_000).await;
        let after = rss_kib();
        // Kept, two million samples would take at least 16 MB.
        assert!(
            after < before + 4 * 1024,
            "RSS grew from {before} KiB to {after} KiB while nobody scraped"
        );
    }
}
