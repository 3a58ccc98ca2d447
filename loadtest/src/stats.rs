//! What the load generator itself counts during one scenario: outcomes of
//! lock operations, active locks, requests in flight, and acquire latency
//! in an HDR histogram at microsecond resolution (etcd answers in well under
//! a millisecond here).
//!
//! Latency is each acquire's own: from just before the request is sent
//! (after any throttle slot was granted) to its whole answer read. Nothing
//! is back-filled. A goose user waits for each answer before it sends again,
//! so at a fixed rate a slow answer can only hold sends back when every user
//! is waiting at once; the most requests in flight at once is kept beside
//! the histogram, and a peak below the number of users means no send of
//! that window waited for an earlier answer.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

/// Latencies of one kind of operation.
pub struct Latency {
    /// std `Mutex`: held for one `record` (nanoseconds), never across an await.
    histogram: Mutex<Histogram<u64>>,
}

impl Default for Latency {
    fn default() -> Self {
        Self::new()
    }
}

impl Latency {
    pub fn new() -> Self {
        // 1 µs to 10 min, 3 significant digits.
        let h = Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds");
        Self {
            histogram: Mutex::new(h),
        }
    }

    pub fn record(&self, took: Duration) {
        let us = (took.as_micros() as u64).clamp(1, 600_000_000);
        let _ = self.histogram.lock().expect("histogram").record(us);
    }

    pub fn percentiles(&self) -> Percentiles {
        percentiles(&self.histogram.lock().expect("histogram"))
    }
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    let ms = |us: u64| us as f64 / 1000.0;
    if h.is_empty() {
        return Percentiles::default();
    }
    Percentiles {
        count: h.len(),
        p50_ms: ms(h.value_at_quantile(0.50)),
        p90_ms: ms(h.value_at_quantile(0.90)),
        p99_ms: ms(h.value_at_quantile(0.99)),
        p999_ms: ms(h.value_at_quantile(0.999)),
        max_ms: ms(h.max()),
    }
}

/// Counters for one scenario, shared by its users.
pub struct Stats {
    /// Acquires that granted a lock.
    pub acquired: AtomicU64,
    /// Acquires answered `acquired: false` (someone else holds the name).
    pub not_acquired: AtomicU64,
    pub released: AtomicU64,
    /// Locks confirmed renewed (each lock of a batch counts once).
    pub renewed: AtomicU64,
    /// Locks a renewal found gone: a lease that ran out under load.
    pub lost: AtomicU64,
    /// The same, by the router's reason (`expired`, `stolen`,
    /// `shard_unavailable`).
    lost_by: Mutex<BTreeMap<String, u64>>,
    /// Lock renewals answered `shard_unavailable`, retried (not lost).
    pub renew_retried: AtomicU64,
    /// Failed operations of any kind: transport errors, unexpected statuses
    /// or bodies, etcd errors in baselines, lost locks.
    pub errors: AtomicU64,
    /// Answers with a 5xx status.
    pub server_errors: AtomicU64,
    /// The same, by status and the error code of their JSON body.
    server_errors_by: Mutex<BTreeMap<String, u64>>,
    /// The first error message of each of those, so a failed check says
    /// what the router answered.
    server_error_first: Mutex<BTreeMap<String, String>>,
    /// HTTP requests (or etcd RPCs in baselines) sent.
    pub requests: AtomicU64,
    /// Locks held right now, and the most held at once.
    pub active: AtomicU64,
    pub active_peak: AtomicU64,
    /// Worst lateness of a scheduled renewal, in ms.
    pub renew_lag_max_ms: AtomicU64,
    /// Requests sent and not yet answered, and the most at once.
    in_flight: AtomicU64,
    pub in_flight_peak: AtomicU64,
    pub latency: Latency,
    /// Grants per user, to judge fairness under contention.
    grants_by_user: Mutex<HashMap<usize, u64>>,
    /// First and latest request: the window rates are computed over (goose's
    /// start-up and report writing are not load).
    span: Mutex<Option<(Instant, Instant)>>,
}

impl Default for Stats {
    fn default() -> Self {
        Self::new()
    }
}

impl Stats {
    pub fn new() -> Self {
        Self {
            acquired: AtomicU64::new(0),
            not_acquired: AtomicU64::new(0),
            released: AtomicU64::new(0),
            renewed: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            lost_by: Mutex::new(BTreeMap::new()),
            renew_retried: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            server_errors: AtomicU64::new(0),
            server_errors_by: Mutex::new(BTreeMap::new()),
            server_error_first: Mutex::new(BTreeMap::new()),
            requests: AtomicU64::new(0),
            active: AtomicU64::new(0),
            active_peak: AtomicU64::new(0),
            renew_lag_max_ms: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            in_flight_peak: AtomicU64::new(0),
            latency: Latency::new(),
            grants_by_user: Mutex::new(HashMap::new()),
            span: Mutex::new(None),
        }
    }

    pub fn granted(&self, user: usize, took: Duration) {
        self.acquired.fetch_add(1, Relaxed);
        self.latency.record(took);
        let now = self.active.fetch_add(1, Relaxed) + 1;
        self.active_peak.fetch_max(now, Relaxed);
        *self
            .grants_by_user
            .lock()
            .expect("grants")
            .entry(user)
            .or_default() += 1;
    }

    pub fn refused(&self, took: Duration) {
        self.not_acquired.fetch_add(1, Relaxed);
        self.latency.record(took);
    }

    pub fn released_one(&self) {
        self.released.fetch_add(1, Relaxed);
        self.active.fetch_sub(1, Relaxed);
    }

    pub fn error(&self) {
        self.errors.fetch_add(1, Relaxed);
    }

    pub fn status(&self, code: u16) {
        if code >= 500 {
            self.server_errors.fetch_add(1, Relaxed);
        }
    }

    /// Counts a 5xx answer by its status and the error code of its body
    /// (`?` if it has none), so that a run's 5xx say what they were.
    pub fn server_error(&self, status: u16, body: &str) {
        let error = serde_json::from_str::<serde_json::Value>(body)
            .ok()
            .map(|v| v["error"].clone());
        let field = |name: &str| {
            error
                .as_ref()
                .and_then(|e| e[name].as_str().map(str::to_string))
        };
        let key = format!("{status} {}", field("code").unwrap_or_else(|| "?".into()));
        self.server_error_first
            .lock()
            .expect("server errors")
            .entry(key.clone())
            .or_insert_with(|| {
                field("message").unwrap_or_else(|| body.chars().take(200).collect())
            });
        *self
            .server_errors_by
            .lock()
            .expect("server errors")
            .entry(key)
            .or_default() += 1;
    }

    /// The first message of each kind of 5xx counted.
    pub fn server_error_first(&self) -> BTreeMap<String, String> {
        self.server_error_first
            .lock()
            .expect("server errors")
            .clone()
    }

    /// The 5xx answers counted by [`Stats::server_error`].
    pub fn server_errors_by(&self) -> BTreeMap<String, u64> {
        self.server_errors_by.lock().expect("server errors").clone()
    }

    pub fn request(&self) {
        self.requests.fetch_add(1, Relaxed);
        let now = Instant::now();
        let mut span = self.span.lock().expect("span");
        *span = Some(span.map_or((now, now), |(first, _)| (first, now)));
    }

    /// Counts a request in flight until the guard drops.
    pub fn sending(&self) -> InFlight<'_> {
        let now = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.in_flight_peak.fetch_max(now, Relaxed);
        InFlight(self)
    }

    /// Seconds from the first request to the latest.
    pub fn seconds(&self) -> f64 {
        self.span
            .lock()
            .expect("span")
            .map_or(0.0, |(a, b)| b.duration_since(a).as_secs_f64())
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }

    pub fn renew_lag(&self, lag: Duration) {
        self.renew_lag_max_ms
            .fetch_max(lag.as_millis() as u64, Relaxed);
    }

    /// Jain's fairness index of grants over the users that tried (1.0: all
    /// got the same share; 1/n: one user got everything), and the fewest and
    /// most grants a user got.
    pub fn fairness(&self, users: usize) -> (f64, u64, u64) {
        let map = self.grants_by_user.lock().expect("grants");
        let counts: Vec<f64> = (0..users)
            .map(|u| map.get(&u).copied().unwrap_or(0) as f64)
            .collect();
        let sum: f64 = counts.iter().sum();
        let sq: f64 = counts.iter().map(|c| c * c).sum();
        let jain = if sq == 0.0 {
            0.0
        } else {
            sum * sum / (counts.len() as f64 * sq)
        };
        let min = counts.iter().cloned().fold(f64::MAX, f64::min);
        let max = counts.iter().cloned().fold(0.0, f64::max);
        (jain, min as u64, max as u64)
    }
}

/// A request in flight; see [`Stats::sending`].
pub struct InFlight<'a>(&'a Stats);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

impl Stats {
    /// A renewal answered `renewed: false` with `reason`.
    pub fn lose(&self, reason: &str) {
        self.lost.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *self
            .lost_by
            .lock()
            .expect("lost lock")
            .entry(reason.to_string())
            .or_default() += 1;
    }

    /// A lock renewal answered `shard_unavailable`: retried.
    pub fn renew_retried(&self) {
        self.renew_retried
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Lost locks by the router's reason.
    pub fn lost_by(&self) -> BTreeMap<String, u64> {
        self.lost_by.lock().expect("lost lock").clone()
    }
}

/// `x` rounded to `digits` decimals, for reports.
pub fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_is_what_was_recorded() {
        let l = Latency::new();
        for _ in 0..99 {
            l.record(Duration::from_micros(500));
        }
        l.record(Duration::from_secs(1));
        let p = l.percentiles();
        assert_eq!(p.count, 100);
        assert!(p.p50_ms < 1.0 && p.max_ms > 999.0, "{p:?}");
    }

    #[test]
    fn in_flight_peak() {
        let s = Stats::new();
        {
            let _a = s.sending();
            let _b = s.sending();
        }
        let _c = s.sending();
        assert_eq!(Stats::get(&s.in_flight_peak), 2);
    }

    #[test]
    fn fairness_index() {
        let s = Stats::new();
        for u in 0..4 {
            s.granted(u, Duration::from_micros(100));
        }
        assert!((s.fairness(4).0 - 1.0).abs() < 1e-9);
        let s = Stats::new();
        s.granted(0, Duration::from_micros(100));
        assert!((s.fairness(4).0 - 0.25).abs() < 1e-9);
    }
}
