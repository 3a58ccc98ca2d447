//! Every answer body of the API, as a typed struct (camelCase JSON): what
//! `docs/openapi.yaml` documents, and what the contract tests check real
//! answers against. Handlers build these; nothing patches JSON by hand, and
//! the one answer written by hand, renew-batch's (the largest, an entry per
//! lock), is held by the tests to the bytes serde writes for its struct.

use std::collections::{BTreeMap, HashMap};
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde::Serialize;

use crate::locks::{Expiry, RenewOutcome};
use crate::placement::topology::{Router, ShardFacts, ShardState};

/// A JSON response.
pub fn json(status: StatusCode, value: &impl serde::Serialize) -> Response<Full<Bytes>> {
    json_sized(status, value, 256)
}

/// A JSON response whose body takes about `size` bytes (one allocation
/// for a renew-batch's answer instead of one per doubling).
fn json_sized(
    status: StatusCode,
    value: &impl serde::Serialize,
    size: usize,
) -> Response<Full<Bytes>> {
    let mut bytes = Vec::with_capacity(size);
    serde_json::to_writer(&mut bytes, value).expect("answers serialise");
    bytes_answer(status, bytes)
}

/// A JSON response of `bytes`.
fn bytes_answer(status: StatusCode, bytes: Vec<u8>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(bytes)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// `expiresAt` (RFC 3339 UTC, milliseconds) and `expiresInMs`, read off one
/// clock sample.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Times {
    pub expires_at: String,
    pub expires_in_ms: u64,
}

impl Times {
    pub fn of(e: &Expiry) -> Self {
        Self::from_report(e.report())
    }

    fn from_report((ms, at): (u64, SystemTime)) -> Self {
        Self {
            expires_at: humantime::format_rfc3339_millis(at).to_string(),
            expires_in_ms: ms,
        }
    }
}

/// The [`Times`] of many answers off one clock sample, each expiry
/// formatted once: the locks of one session lease in a renew-batch share
/// their expiry, and follow each other.
pub struct TimesAt {
    now: Instant,
    wall: SystemTime,
    /// Each expiry's times, in the order first asked for.
    formatted: Vec<(Instant, Times)>,
    /// Where in `formatted` each expiry is.
    index: HashMap<Instant, usize>,
    /// The last one asked for: the next lock's, most often.
    last: usize,
}

impl TimesAt {
    pub fn now() -> Self {
        Self {
            now: Instant::now(),
            wall: SystemTime::now(),
            formatted: Vec::new(),
            index: HashMap::new(),
            last: 0,
        }
    }

    pub fn of(&mut self, e: &Expiry) -> Times {
        self.format(e).clone()
    }

    /// The times of `e`, formatted on first use.
    pub fn format(&mut self, e: &Expiry) -> &Times {
        let i = match self.formatted.get(self.last) {
            Some((at, _)) if *at == e.0 => self.last,
            _ => {
                let Self {
                    now,
                    wall,
                    formatted,
                    index,
                    ..
                } = self;
                *index.entry(e.0).or_insert_with(|| {
                    let times = Times::from_report(e.report_at(*now, *wall));
                    formatted.push((e.0, times));
                    formatted.len() - 1
                })
            }
        };
        self.last = i;
        &self.formatted[i].1
    }

    /// The times of `e`, once [`format`](Self::format) has formatted them.
    #[cfg(test)]
    fn formatted(&self, e: &Expiry) -> &Times {
        &self.formatted[self.index[&e.0]].1
    }

    /// Makes `times` the times of the expiry `at`.
    #[cfg(test)]
    fn set(&mut self, at: Instant, times: Times) {
        self.index.insert(at, self.formatted.len());
        self.formatted.push((at, times));
    }
}

/// `acquire` granted.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Granted {
    pub acquired: bool,
    pub lock_id: String,
    pub fencing_token: u64,
    #[serde(flatten)]
    pub times: Times,
}

/// `acquire` not granted: held by another, queued, or waiting out a lost
/// holder's lock-delay until `expiresAt`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NotAcquired {
    pub acquired: bool,
    pub expires_at: String,
}

/// `renew` (and each renewed entry of `renew-batch`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Renewed {
    pub renewed: bool,
    #[serde(flatten)]
    pub times: Times,
}

/// `extend` done: the lock rides on the session lease of its new TTL,
/// under a new lockId, with the same fencing token.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtendedLock {
    pub renewed: bool,
    pub lock_id: String,
    pub fencing_token: u64,
    #[serde(flatten)]
    pub times: Times,
}

/// A refused renewal: `expired`, `stolen` or (in batches)
/// `shard_unavailable`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NotRenewed {
    pub renewed: bool,
    pub reason: &'static str,
}

/// One answer of a renewal.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum RenewAnswer {
    Renewed(Renewed),
    NotRenewed(NotRenewed),
}

/// One entry of `renew-batch`'s answer, in request order: its lockId and
/// the fields of [`Renewed`] or of [`NotRenewed`], borrowing the lockId
/// from the request and the times from one [`TimesAt`]. The answer's
/// schema: [`renew_batch_answer`] writes the same bytes without serde.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchEntry<'a> {
    pub lock_id: &'a str,
    pub renewed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
}

impl<'a> BatchEntry<'a> {
    /// The entry of `lock_id`; a renewed one's expiry must have been
    /// [`TimesAt::format`]ted in `times`.
    #[cfg(test)]
    fn of(lock_id: &'a str, o: &RenewOutcome, times: &'a TimesAt) -> Self {
        let (times, reason) = match renewal(o) {
            Ok(e) => (Some(times.formatted(e)), None),
            Err(reason) => (None, Some(reason)),
        };
        Self {
            lock_id,
            renewed: times.is_some(),
            expires_at: times.map(|t| t.expires_at.as_str()),
            expires_in_ms: times.map(|t| t.expires_in_ms),
            reason,
        }
    }
}

/// A renewed lock's new expiry, or why the renewal was refused (its
/// `reason`).
pub fn renewal(o: &RenewOutcome) -> Result<&Expiry, &'static str> {
    match o {
        RenewOutcome::Renewed(e) => Ok(e),
        RenewOutcome::Expired => Err("expired"),
        RenewOutcome::Stolen => Err("stolen"),
        RenewOutcome::Unavailable => Err("shard_unavailable"),
    }
}

#[derive(Debug, Serialize)]
pub struct BatchAnswer<'a> {
    pub results: Vec<BatchEntry<'a>>,
}

/// `renew-batch`'s answer: an entry per lock of the request, in its order,
/// the expiries read off one clock sample and each formatted once.
///
/// Written entry by entry into one buffer of about its size: the bytes
/// serde writes for [`BatchAnswer`] (the tests hold the two to each other),
/// without serde's pass over each lockId for characters to escape (a
/// lockId that was opened is base64url; any other is escaped as serde
/// would) nor a map lookup per entry for its times ([`TimesAt`] looks up
/// only a lease's first lock).
pub fn renew_batch_answer(
    locks: &[(&str, u64)],
    outcomes: &[RenewOutcome],
) -> Response<Full<Bytes>> {
    let mut times = TimesAt::now();
    // An entry is its lockId and at most about 90 bytes around it.
    let size = 16 + (locks.iter()).map(|(id, _)| id.len() + 96).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(b"{\"results\":[");
    for (i, (&(lock_id, _), o)) in locks.iter().zip(outcomes).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"lockId\":");
        write_json_str(&mut out, lock_id);
        match renewal(o) {
            Ok(e) => {
                let t = times.format(e);
                out.extend_from_slice(b",\"renewed\":true,\"expiresAt\":");
                write_json_str(&mut out, &t.expires_at);
                out.extend_from_slice(b",\"expiresInMs\":");
                out.extend_from_slice(itoa::Buffer::new().format(t.expires_in_ms).as_bytes());
            }
            Err(reason) => {
                out.extend_from_slice(b",\"renewed\":false,\"reason\":");
                write_json_str(&mut out, reason);
            }
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    bytes_answer(StatusCode::OK, out)
}

/// `s` as a JSON string: as is between quotes when nothing in it needs
/// escaping (JSON escapes only quotes, backslashes and control
/// characters: never in lockIds, times or reasons), else as serde writes
/// it. The check folds every byte without a branch, so that it runs as
/// vector instructions instead of a guess per byte.
fn write_json_str(out: &mut Vec<u8>, s: &str) {
    let escaped = (s.bytes()).fold(false, |e, b| e | (b < 0x20) | (b == b'"') | (b == b'\\'));
    if !escaped {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(out, s).expect("a string serialises");
    }
}

/// `GET /api/v1/locks/{name}`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Inspected {
    pub name: String,
    pub held: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// When the holder was granted it (locks granted by older routers
    /// have none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acquired_at: Option<String>,
    /// What the holder attached at acquire.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
    /// Waiting acquires queued for the name, when any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiters: Option<u64>,
    /// The holder's principal, for admin callers only (when it has one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    /// The holder's clientId, for admin callers only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    pub shard: String,
}

/// `POST /admin/v1/locks/{name}/force-release`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ForceReleased {
    pub name: String,
    pub released: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<u64>,
    /// The former holder's principal (when it had one) and clientId.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
}

/// `GET /admin/v1/locks`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LockList {
    pub locks: Vec<ListedLock>,
    /// Where the next page starts; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// A held lock in a listing.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedLock {
    pub name: String,
    pub shard: String,
    pub fencing_token: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    pub client_id: String,
    pub ttl_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acquired_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
    /// When its session lease ends unless renewed, and the time it has
    /// left, as etcd said while listing.
    #[serde(flatten)]
    pub times: Option<Times>,
}

impl ListedLock {
    pub fn of(l: &crate::locks::listing::Listed) -> Self {
        let (principal, client_id) = crate::locks::split_holder(&l.holder);
        Self {
            name: l.name.clone(),
            shard: l.shard.clone(),
            fencing_token: l.fencing_token,
            principal: Some(principal.to_string()).filter(|p| !p.is_empty()),
            client_id: client_id.to_string(),
            ttl_ms: u64::from(l.ttl_secs) * 1000,
            acquired_at: l
                .acquired_at
                .map(|t| humantime::format_rfc3339_millis(t).to_string()),
            metadata: l.metadata.clone(),
            times: l.expires.as_ref().map(Times::of),
        }
    }
}

/// `GET /admin/v1/clients/{clientId}`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientAnswer {
    pub client_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    pub locks: Vec<ListedLock>,
    pub sessions: Vec<SessionAnswer>,
    /// The client holds more locks than the answer lists.
    pub truncated: bool,
}

/// A session lease of a client on a shard.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionAnswer {
    pub shard: String,
    /// The etcd lease id.
    pub lease: i64,
    pub ttl_ms: u64,
    /// What etcd gives it now, unless renewed (whole seconds, rounded down).
    #[serde(flatten)]
    pub times: Times,
    /// Locks riding on it.
    pub locks: usize,
}

impl SessionAnswer {
    pub fn of(s: &crate::locks::listing::SessionView) -> Self {
        Self {
            shard: s.shard.clone(),
            lease: s.lease,
            ttl_ms: u64::from(s.ttl_secs) * 1000,
            times: Times::of(&s.expires),
            locks: s.locks,
        }
    }
}

/// `GET /healthz`.
#[derive(Debug, Serialize)]
pub struct Health {
    pub status: &'static str,
}

/// `GET /readyz`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Readiness {
    pub ready: bool,
    /// This replica's version (`lockrouter --version`), for telling
    /// replicas apart during a rolling upgrade.
    pub version: &'static str,
    /// This replica's host name (a pod's name under Kubernetes): which
    /// replica answered, behind a load balancer.
    pub replica: String,
    /// How long this replica has served.
    pub uptime_ms: u64,
    pub shards: Vec<ShardReadiness>,
    pub unreachable_shards: Vec<String>,
    pub refusing_shards: Vec<String>,
    pub migration: Option<MigrationView>,
}

#[derive(Debug, Serialize)]
pub struct ShardReadiness {
    pub name: String,
    pub state: ShardState,
}

/// Who this replica is, as `/readyz` says it.
#[derive(Debug, Clone)]
pub struct Replica {
    /// The host name; empty if the system gives none.
    pub name: String,
    /// When it started (built its router).
    pub started: std::time::Instant,
}

impl Replica {
    /// This host's replica, starting now.
    pub fn starting() -> Self {
        let name = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_default();
        Self {
            name,
            started: std::time::Instant::now(),
        }
    }
}

impl Readiness {
    pub fn of(router: &Router, replica: &Replica) -> Self {
        let (unreachable_shards, refusing_shards) = router.readiness();
        Self {
            ready: router.ready(),
            version: env!("CARGO_PKG_VERSION"),
            replica: replica.name.clone(),
            uptime_ms: replica.started.elapsed().as_millis() as u64,
            shards: router
                .shard_states()
                .into_iter()
                .map(|(name, state)| ShardReadiness { name, state })
                .collect(),
            unreachable_shards,
            refusing_shards,
            migration: MigrationView::of(router),
        }
    }
}

/// The open migration a router follows.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationView {
    pub from_ring: Option<String>,
    pub to_ring: String,
    pub epoch: u64,
    /// Moved names still on each previous shard, at the last count.
    pub moved_locks_held: BTreeMap<String, i64>,
}

impl MigrationView {
    pub fn of(router: &Router) -> Option<Self> {
        let m = router.migration()?;
        let moved = m.moved_held.lock().expect("moved lock").clone();
        Some(Self {
            from_ring: m.recorded.meta.previous.as_ref().map(|p| p.ring.clone()),
            to_ring: m.recorded.meta.ring.clone(),
            epoch: m.recorded.meta.epoch,
            moved_locks_held: moved,
        })
    }
}

/// `GET /admin/v1/ring`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RingView {
    pub ring: String,
    pub epoch: Option<u64>,
    pub granting: bool,
    pub shards: Vec<ShardView>,
    pub migration: Option<MigrationView>,
}

/// A shard in `GET /admin/v1/ring`: of the ring (`active`, with its
/// weight), or of a migration's previous ring only (`draining`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardView {
    pub name: String,
    pub state: &'static str,
    pub up: bool,
    pub recorded_ring: Option<String>,
    pub recorded_epoch: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

impl ShardView {
    fn of(f: ShardFacts) -> Self {
        Self {
            name: f.name,
            state: f.role,
            up: f.up,
            recorded_ring: f.recorded_ring,
            recorded_epoch: f.recorded_epoch,
            weight: f.weight,
        }
    }
}

impl RingView {
    pub fn of(router: &Router) -> Self {
        let shards = router
            .shard_facts()
            .into_iter()
            .map(ShardView::of)
            .collect();
        Self {
            ring: router.ring.fingerprint().to_string(),
            epoch: router.epoch(),
            granting: router.granting(),
            shards,
            migration: MigrationView::of(router),
        }
    }
}

/// `POST /admin/v1/bump-epoch`.
#[derive(Debug, Serialize)]
pub struct Bumped {
    pub epoch: u64,
}

/// Every error answer: `{"error": {"code", "message", "requestId"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorDetail<'a> {
    pub code: &'a str,
    pub message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renew_batch_answers_are_the_bytes_serde_writes() {
        let at = Instant::now();
        let e = |ms| RenewOutcome::Renewed(Expiry(at + std::time::Duration::from_millis(ms)));
        let cases: Vec<(&str, RenewOutcome)> = vec![
            ("AQAB-_x9", e(29_990)),
            ("AQAC", e(29_990)),
            ("AQAD", RenewOutcome::Expired),
            ("AQAE", e(12_000)),
            // Lockids are opened before they are answered, but the
            // answer does not rely on it.
            ("a\"b\\c\u{1}é", e(29_990)),
            ("é\u{7f}/<>", RenewOutcome::Expired),
            ("tab\tin", RenewOutcome::Expired),
            ("AQAF", RenewOutcome::Stolen),
            ("", RenewOutcome::Unavailable),
            ("AQAG", e(0)),
        ];
        for n in [1, 2, cases.len()] {
            let locks: Vec<(&str, u64)> = cases[..n].iter().map(|(id, _)| (*id, 1)).collect();
            let outcomes: Vec<RenewOutcome> = cases[..n].iter().map(|(_, o)| *o).collect();
            let resp = renew_batch_answer(&locks, &outcomes);
            assert_eq!(resp.status(), StatusCode::OK);
            assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
            let written = body_bytes(resp);
            // serde's bytes for the same answer, off the same expiries: the
            // times are read back from what was written (one clock sample).
            let answer: serde_json::Value = serde_json::from_slice(&written).unwrap();
            let mut times = TimesAt::now();
            for (o, got) in outcomes.iter().zip(answer["results"].as_array().unwrap()) {
                if let Ok(e) = renewal(o) {
                    let t = Times {
                        expires_at: got["expiresAt"].as_str().unwrap().into(),
                        expires_in_ms: got["expiresInMs"].as_u64().unwrap(),
                    };
                    times.set(e.0, t);
                }
            }
            let results = (locks.iter().zip(&outcomes))
                .map(|(&(id, _), o)| BatchEntry::of(id, o, &times))
                .collect();
            let want = serde_json::to_vec(&BatchAnswer { results }).unwrap();
            assert_eq!(
                String::from_utf8(written).unwrap(),
                String::from_utf8(want).unwrap()
            );
        }
    }

    /// Locks of one lease share an expiry; the expiries of a batch are read
    /// off one clock sample, so equal expiries are written equal.
    #[test]
    fn a_batchs_equal_expiries_are_written_alike() {
        let at = Instant::now() + std::time::Duration::from_millis(20_000);
        let locks = [("AQAB", 1), ("AQAC", 1), ("AQAD", 1)];
        let outcomes = [
            RenewOutcome::Renewed(Expiry(at)),
            RenewOutcome::Expired,
            RenewOutcome::Renewed(Expiry(at)),
        ];
        let answer: serde_json::Value =
            serde_json::from_slice(&body_bytes(renew_batch_answer(&locks, &outcomes))).unwrap();
        let r = &answer["results"];
        assert_eq!(r[0]["expiresAt"], r[2]["expiresAt"]);
        assert_eq!(r[0]["expiresInMs"], r[2]["expiresInMs"]);
        assert!(r[0]["expiresInMs"].as_u64().unwrap() <= 20_000);
        assert_eq!(
            r[1],
            json!({"lockId": "AQAC", "renewed": false, "reason": "expired"})
        );
    }

    /// Each expiry is formatted once, whichever lease's lock comes next.
    #[test]
    fn times_at_formats_each_expiry_once() {
        let mut times = TimesAt::now();
        let a = Expiry(times.now + std::time::Duration::from_millis(20_000));
        let b = Expiry(times.now + std::time::Duration::from_millis(9_000));
        let mut seen = Vec::new();
        for e in [a, a, b, a, b, b] {
            let t = times.format(&e);
            seen.push((t.expires_at.clone(), t.expires_in_ms));
        }
        assert_eq!(times.formatted.len(), 2);
        assert_eq!((seen[0].1, seen[2].1), (20_000, 9_000));
        for (i, e) in [a, a, b, a, b, b].iter().enumerate() {
            let first = if e.0 == a.0 { &seen[0] } else { &seen[2] };
            assert_eq!(&seen[i], first, "lock {i}");
        }
        assert_ne!(seen[0].0, seen[2].0);
    }

    fn body_bytes(resp: Response<Full<Bytes>>) -> Vec<u8> {
        use http_body_util::BodyExt;
        let body = resp.into_body();
        futures::executor::block_on(body.collect())
            .unwrap()
            .to_bytes()
            .to_vec()
    }

    #[test]
    fn answers_serialise_as_the_api_documents_them() {
        let times = || Times {
            expires_at: "2026-11-30T03:38:50.123Z".into(),
            expires_in_ms: 29_990,
        };
        let granted = Granted {
            acquired: true,
            lock_id: "AQAB".into(),
            fencing_token: 4711,
            times: times(),
        };
        assert_eq!(
            serde_json::to_value(&granted).unwrap(),
            json!({"acquired": true, "lockId": "AQAB", "fencingToken": 4711,
                   "expiresAt": "2026-11-30T03:38:50.123Z", "expiresInMs": 29990})
        );
        let mut at = TimesAt::now();
        let e = Expiry(at.now + std::time::Duration::from_millis(29_990));
        let renewed = RenewOutcome::Renewed(e);
        at.format(&e);
        let expires_at = at.formatted(&e).expires_at.clone();
        for (o, want) in [
            (
                renewed,
                json!({"lockId": "AQAB", "renewed": true,
                       "expiresAt": expires_at, "expiresInMs": 29990}),
            ),
            (
                RenewOutcome::Expired,
                json!({"lockId": "AQAB", "renewed": false, "reason": "expired"}),
            ),
            (
                RenewOutcome::Stolen,
                json!({"lockId": "AQAB", "renewed": false, "reason": "stolen"}),
            ),
            (
                RenewOutcome::Unavailable,
                json!({"lockId": "AQAB", "renewed": false, "reason": "shard_unavailable"}),
            ),
        ] {
            let entry = BatchEntry::of("AQAB", &o, &at);
            assert_eq!(serde_json::to_value(&entry).unwrap(), want);
            let mut batch = serde_json::to_string(&entry).unwrap();
            // The same fields, in the same order, as a single renew's answer.
            let single = match renewal(&o) {
                Ok(e) => serde_json::to_string(&Renewed {
                    renewed: true,
                    times: at.of(e),
                }),
                Err(reason) => serde_json::to_string(&NotRenewed {
                    renewed: false,
                    reason,
                }),
            }
            .unwrap();
            batch = batch.replacen("\"lockId\":\"AQAB\",", "", 1);
            assert_eq!(batch, single);
        }
        let free = Inspected {
            name: "n".into(),
            held: false,
            fencing_token: None,
            expires_at: None,
            acquired_at: None,
            metadata: None,
            waiters: None,
            principal: None,
            client_id: None,
            shard: "a".into(),
        };
        assert_eq!(
            serde_json::to_value(&free).unwrap(),
            json!({"name": "n", "held": false, "shard": "a"})
        );
    }
}
