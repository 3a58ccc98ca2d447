//! A recorded history of lock operations and a checker for the safety
//! invariants, reusable by any test that drives locks under faults:
//! - no two grants of one name are valid at the same moment, each grant
//!   being valid (as the SDK judges it, with the same monotonic clock) from
//!   when its answer arrived until `sent + expiresInMs`, or until its holder
//!   sent the release;
//! - fencing tokens of one name strictly increase in grant order;
//! - no answer was a 5xx other than 503 `shard_unavailable` or
//!   `overloaded`, and each 503 fell inside a window the test declared
//!   (e.g. a migration's fence).
//!
//! A failed check writes the whole history to a file in the temp dir and
//! names it in the panic message. A test can add a timeline to it: what it
//! did when ([`note`](History::note): faults, leader changes) and what
//! happened to each name's keys in etcd ([`journal`](History::journal)),
//! both shown beside each violation, so an overlap can be matched to the
//! fault and the etcd events that led to it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Grant {
    pub name: String,
    /// Answers with one lockId are one grant (an idempotent re-acquire).
    pub lock_id: String,
    pub token: u64,
    /// When the acquire was sent: the lease is judged from here, as the
    /// SDK judges it.
    pub sent: Instant,
    /// When its answer arrived: the grant is valid from here.
    pub received: Instant,
    /// The answer's `expiresInMs`.
    pub expires_in: Duration,
    /// When the holder sent its release, if it did.
    pub released: Option<Instant>,
}

impl Grant {
    /// Its timeline in ms since `origin` (the first request of the run).
    fn describe(&self, origin: Option<Instant>) -> String {
        let ms = |t: Instant| origin.map_or(0, |o| t.saturating_duration_since(o).as_millis());
        format!(
            "lockId {} sent {} received {} valid until {} (released {:?})",
            self.lock_id,
            ms(self.sent),
            ms(self.received),
            ms(self.valid_until()),
            self.released.map(ms)
        )
    }

    fn valid_until(&self) -> Instant {
        let lease_end = self.sent + self.expires_in;
        self.released.map_or(lease_end, |r| r.min(lease_end))
    }
}

#[derive(Debug, Clone)]
pub struct Refusal {
    pub status: u16,
    /// The error code of the body.
    pub code: String,
    /// When the answer arrived, to place it inside or outside a window.
    pub at: Instant,
}

#[derive(Default)]
struct Inner {
    grants: Vec<Grant>,
    /// Error answers; each must fall in one of `windows`.
    refusals: Vec<Refusal>,
    /// Where 503 `shard_unavailable` is expected (declared fences).
    windows: Vec<(Instant, Instant)>,
    /// Every acquire sent, so a test can show it did real work.
    attempts: usize,
    /// What times are counted from; else the first request's send.
    origin: Option<Instant>,
    /// What the test did and saw, when (faults, leader changes).
    notes: Vec<(Instant, String)>,
    /// Events of one name's keys in etcd: (seen at, name, what).
    journal: Vec<(Instant, String, String)>,
}

/// Shared by every worker of a test.
#[derive(Clone, Default)]
pub struct History(Arc<Mutex<Inner>>);

impl History {
    pub fn attempt(&self) {
        self.0.lock().unwrap().attempts += 1;
    }

    /// Records a grant; returns its index for [`released`](Self::released).
    pub fn granted(&self, g: Grant) -> usize {
        let mut h = self.0.lock().unwrap();
        h.grants.push(g);
        h.grants.len() - 1
    }

    pub fn released(&self, index: usize, at: Instant) {
        self.0.lock().unwrap().grants[index].released = Some(at);
    }

    pub fn refused(&self, status: u16, code: &str, at: Instant) {
        let code = code.to_string();
        self.0
            .lock()
            .unwrap()
            .refusals
            .push(Refusal { status, code, at });
    }

    /// Counts every time in the written history from `at` (e.g. the test's
    /// start, so that faults noted before the first grant line up).
    pub fn start(&self, at: Instant) {
        self.0.lock().unwrap().origin = Some(at);
    }

    /// Records what the test did or saw at `at` (a fault starting or
    /// ending, a leader change), for the written history.
    pub fn note(&self, at: Instant, what: impl Into<String>) {
        self.0.lock().unwrap().notes.push((at, what.into()));
    }

    /// Records an event of name `name` at `at` (a lock key put or deleted
    /// in etcd, with its revision and lease; a client's grant), for the
    /// written history and the violations of that name.
    pub fn journal(&self, at: Instant, name: &str, what: impl Into<String>) {
        let entry = (at, name.to_string(), what.into());
        self.0.lock().unwrap().journal.push(entry);
    }

    /// Declares a window in which 503s are expected (a fence).
    pub fn allow_unavailable(&self, from: Instant, to: Instant) {
        self.0.lock().unwrap().windows.push((from, to));
    }

    /// How many grants (distinct lockIds, renewals aside) were first
    /// answered inside one of `windows`: proof that a fault did not stop
    /// service. Call it before [`check`](Self::check), which consumes the
    /// history.
    pub fn grants_received_within(&self, windows: &[(Instant, Instant)]) -> usize {
        let h = self.0.lock().unwrap();
        let mut first: BTreeMap<&str, Instant> = BTreeMap::new();
        for g in &h.grants {
            first
                .entry(g.lock_id.as_str())
                .and_modify(|at| *at = (*at).min(g.received))
                .or_insert(g.received);
        }
        first
            .values()
            .filter(|at| windows.iter().any(|(from, to)| (from..=to).contains(at)))
            .count()
    }

    /// Checks every invariant; panics with the first violations found.
    /// Returns (grants, attempts, refusals) so a test can assert it did
    /// real work.
    pub fn check(&self) -> (usize, usize, usize) {
        // Taken out of the mutex, so a failed check poisons nothing.
        let h = std::mem::take(&mut *self.0.lock().unwrap());
        let mut problems = Vec::new();
        // One grant may be answered twice (an idempotent re-acquire): merge.
        let mut by_lock: BTreeMap<&str, Grant> = BTreeMap::new();
        for g in &h.grants {
            by_lock
                .entry(g.lock_id.as_str())
                .and_modify(|m| {
                    m.received = m.received.min(g.received);
                    // The latest lease end any answer vouched for, cut
                    // short by the holder's release, whichever answer it
                    // was recorded on (a release ends the whole grant).
                    if g.sent + g.expires_in > m.sent + m.expires_in {
                        m.sent = g.sent;
                        m.expires_in = g.expires_in;
                    }
                    m.released = match (m.released, g.released) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                })
                .or_insert_with(|| g.clone());
        }
        let origin = h.origin.or_else(|| h.grants.iter().map(|g| g.sent).min());
        let mut by_name: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
        for g in by_lock.values() {
            by_name.entry(g.name.as_str()).or_default().push(g);
        }
        for (name, mut grants) in by_name {
            grants.sort_by_key(|g| g.received);
            for pair in grants.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                if b.received < a.valid_until() {
                    problems.push(format!(
                        "{name}: token {} granted while token {} was still valid ({:?} before it ended)\n  \
                         earlier: {}\n  later:   {}{}",
                        b.token,
                        a.token,
                        a.valid_until() - b.received,
                        a.describe(origin),
                        b.describe(origin),
                        h.nearby(name, a.sent, b.received.max(a.valid_until()), origin),
                    ));
                }
                if b.token <= a.token {
                    problems.push(format!("{name}: token {} after {}", b.token, a.token));
                }
            }
        }
        for r in &h.refusals {
            let allowed = r.status == 503
                && (r.code == "shard_unavailable" || r.code == "overloaded")
                && h.windows
                    .iter()
                    .any(|(from, to)| *from <= r.at && r.at <= *to);
            if !allowed {
                problems.push(format!(
                    "answer {} {} outside any fence window",
                    r.status, r.code
                ));
            }
        }
        if !problems.is_empty() {
            let file = write_history(&h, origin);
            panic!(
                "{} violations (the whole history is in {file}):\n{}",
                problems.len(),
                problems.join("\n")
            );
        }
        (by_lock.len(), h.attempts, h.refusals.len())
    }
}

/// How far before an overlapping pair's first grant, and after its end,
/// notes and journal entries are shown beside it.
const NEARBY_BEFORE: Duration = Duration::from_secs(10);
const NEARBY_AFTER: Duration = Duration::from_secs(2);

impl Inner {
    /// The notes, and the journal entries of `name`, from
    /// [`NEARBY_BEFORE`] before `from` to [`NEARBY_AFTER`] after `to`, one
    /// a line (empty if none).
    fn nearby(&self, name: &str, from: Instant, to: Instant, origin: Option<Instant>) -> String {
        let ms = |t: Instant| origin.map_or(0, |o| t.saturating_duration_since(o).as_millis());
        let (from, to) = (
            from.checked_sub(NEARBY_BEFORE).unwrap_or(from),
            to + NEARBY_AFTER,
        );
        let mut lines: Vec<(Instant, String)> = self
            .notes
            .iter()
            .filter(|(at, _)| (from..=to).contains(at))
            .map(|(at, what)| (*at, format!("    {} {what}", ms(*at))))
            .collect();
        lines.extend(
            self.journal
                .iter()
                .filter(|(at, n, _)| n == name && (from..=to).contains(at))
                .map(|(at, _, what)| (*at, format!("    {} {what}", ms(*at)))),
        );
        lines.sort_by_key(|(at, _)| *at);
        if lines.is_empty() {
            return String::new();
        }
        let lines: Vec<String> = lines.into_iter().map(|(_, l)| l).collect();
        format!("\n  nearby (ms):\n{}", lines.join("\n"))
    }
}

/// Writes every grant and refusal of `h`, in ms since `origin`, to a file
/// in the temp dir, so a failed run can be read; returns its path. Then
/// the test's notes and the etcd journal, if it kept them. The checker's
/// own tests break invariants on purpose and write nothing, so that a
/// passing run leaves no files behind.
fn write_history(h: &Inner, origin: Option<Instant>) -> String {
    if cfg!(test) {
        return "(not written by the checker's own tests)".into();
    }
    let ms = |t: Instant| origin.map_or(0, |o| t.saturating_duration_since(o).as_millis());
    let mut text = String::from(
        "# grants (ms since the test's start, else the first request), then refusals, \
         then the test's notes, then the etcd journal\n",
    );
    let mut grants: Vec<&Grant> = h.grants.iter().collect();
    grants.sort_by_key(|g| (g.name.clone(), g.received));
    for g in grants {
        text.push_str(&format!(
            "{} token {} {}\n",
            g.name,
            g.token,
            g.describe(origin)
        ));
    }
    for r in &h.refusals {
        text.push_str(&format!(
            "refused {} {} at {}\n",
            r.status,
            r.code,
            ms(r.at)
        ));
    }
    if !h.notes.is_empty() {
        text.push_str("# notes: what the test did and saw (faults, leader changes)\n");
        let mut notes: Vec<&(Instant, String)> = h.notes.iter().collect();
        notes.sort_by_key(|(at, _)| *at);
        for (at, what) in notes {
            text.push_str(&format!("note {} {what}\n", ms(*at)));
        }
    }
    if !h.journal.is_empty() {
        text.push_str(
            "# journal: each name's events, by its clients and in etcd (etcd's as a \
             watch delivered them: the time is when the test saw them, the revision \
             orders them)\n",
        );
        let mut journal: Vec<&(Instant, String, String)> = h.journal.iter().collect();
        journal.sort_by_key(|(at, name, _)| (name.clone(), *at));
        for (at, name, what) in journal {
            text.push_str(&format!("journal {name} {} {what}\n", ms(*at)));
        }
    }
    let path = std::env::temp_dir().join(format!(
        "lockrouter-history-{}-{}.txt",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    match std::fs::write(&path, text) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("(not written: {e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(name: &str, id: &str, token: u64, at: Instant, ms: u64) -> Grant {
        Grant {
            name: name.into(),
            lock_id: id.into(),
            token,
            sent: at,
            received: at + Duration::from_millis(1),
            expires_in: Duration::from_millis(ms),
            released: None,
        }
    }

    fn fails(h: &History, needle: &str) {
        let caught = std::panic::catch_unwind(|| h.check()).unwrap_err();
        let msg = caught.downcast_ref::<String>().unwrap();
        assert!(msg.contains(needle), "{msg}");
    }

    #[test]
    fn the_checker_catches_overlap_and_token_regressions() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let h = History::default();
        h.granted(grant("n", "1", 10, t0, 1_000));
        h.granted(grant("n", "2", 11, t0 + ms(500), 1_000));
        fails(&h, "still valid");
        // Notes and the name's journal are shown beside the overlap.
        let h = History::default();
        h.start(t0);
        h.granted(grant("n", "1", 10, t0, 1_000));
        h.granted(grant("n", "2", 11, t0 + ms(500), 1_000));
        h.note(t0 + ms(300), "leader paused");
        h.journal(t0 + ms(400), "n", "etcd rev 7 delete locks/n");
        h.journal(t0 + ms(400), "other", "etcd rev 8 put locks/other");
        fails(&h, "300 leader paused\n    400 etcd rev 7 delete locks/n");
        let h = History::default();
        h.granted(grant("n", "1", 10, t0, 1_000));
        h.granted(grant("n", "2", 11, t0 + ms(500), 1_000));
        h.journal(t0 + ms(400), "other", "etcd rev 8 put locks/other");
        let caught = std::panic::catch_unwind(|| h.check()).unwrap_err();
        let msg = caught.downcast_ref::<String>().unwrap();
        assert!(!msg.contains("locks/other"), "{msg}");
        // Released before the next grant: no overlap.
        let h = History::default();
        let i = h.granted(grant("n", "1", 10, t0, 1_000));
        h.released(i, t0 + ms(100));
        h.granted(grant("n", "2", 11, t0 + ms(200), 1_000));
        h.check();
        let h = History::default();
        let i = h.granted(grant("n", "1", 10, t0, 1_000));
        h.released(i, t0 + ms(100));
        h.granted(grant("n", "2", 9, t0 + ms(200), 1_000));
        fails(&h, "token 9 after 10");
        let h = History::default();
        h.refused(503, "shard_unavailable", t0);
        fails(&h, "outside any fence window");
        let h = History::default();
        h.refused(503, "shard_unavailable", t0);
        h.allow_unavailable(t0, t0 + ms(1_000));
        h.check();
        let h = History::default();
        h.refused(500, "internal", t0);
        h.allow_unavailable(t0, t0 + ms(1_000));
        fails(&h, "500 internal");
    }
}
