//! Paged range reads of a shard's keys, a slice of the hash space at a
//! time ([`Pages`]), and where the paced sweep of lost holders is
//! ([`Sweep`]). The reads themselves are `scan.rs`'s.

use std::time::{Duration, Instant};

use etcd_client::{GetOptions, KeyValue};

use super::conn::{EtcdConn, EtcdError};

/// Where the paced sweep of lost holders is on a shard. A pass reads the
/// held records a page per step (one step per monitor tick), so its cost
/// to etcd is bounded by the tick, not by the number of held locks; a new
/// pass starts at most once per `every` given to [`Sweep::begin`].
#[derive(Default)]
pub struct Sweep {
    pass: Option<Pages>,
    started: Option<Instant>,
}

impl Sweep {
    /// The pass to step on: the one under way, or a new one when the last
    /// began at least `every` ago; `None` otherwise.
    pub(super) fn begin(&mut self, held: (Vec<u8>, Vec<u8>), every: Duration) -> Option<Pages> {
        if let Some(pages) = self.pass.take() {
            return Some(pages);
        }
        if self.started.is_some_and(|t| t.elapsed() < every) {
            return None;
        }
        self.started = Some(Instant::now());
        Some(Pages::new(held, true).unpinned())
    }

    /// Keeps `pages` for the next step, unless its pass is over.
    pub(super) fn keep(&mut self, pages: Pages) {
        if !pages.done {
            self.pass = Some(pages);
        }
    }
}

/// A range read a page of 1,000 keys at a time, every page at the revision
/// of the first.
///
/// Each read covers only a slice of the range's hash space (its keys are
/// `prefix <32 hex digits>`): etcd 3.4 collects every revision of a range
/// before it applies the limit, so pages read to the end of the range would
/// cost O(keys after them) each, O(n²) for the scan. The first slice is
/// the whole range (one read, for a range of fewer than 1,000 keys); a
/// slice that holds more than a page is halved for the next read, one that
/// holds under a quarter of a page doubled. Slices follow each other with
/// no gap: a read that filled its page goes on after its last key, one
/// that did not, at the end of its slice.
pub struct Pages {
    /// The range's start: its keys' common prefix.
    prefix: Vec<u8>,
    from: Vec<u8>,
    end: Vec<u8>,
    keys_only: bool,
    /// Every page at the first page's revision (a scan), or each at the
    /// newest (a paced sweep, whose pass may outlive compaction).
    pinned: bool,
    /// The revision of the last page read; 0 until the first is read.
    pub(super) revision: i64,
    /// Positions of the hash space (see [`hash_position`]) the next read
    /// covers.
    width: u64,
    done: bool,
}

/// Positions in the hash space: the first 32 bits of a hash.
pub(super) const SPACE: u64 = 1 << 32;
/// Keys a page reads.
const PAGE: usize = 1_000;

impl Pages {
    pub(super) fn new((start, end): (Vec<u8>, Vec<u8>), keys_only: bool) -> Self {
        Self {
            prefix: start.clone(),
            from: start,
            end,
            keys_only,
            pinned: true,
            revision: 0,
            width: SPACE,
            done: false,
        }
    }

    fn unpinned(mut self) -> Self {
        self.pinned = false;
        self
    }

    /// Goes on after `key` (a key of the last page) at the next read.
    pub(super) fn resume_after(&mut self, key: &[u8]) {
        self.from = key.to_vec();
        self.from.push(0);
        self.done = self.from >= self.end;
    }

    /// The end (exclusive) of the slice that starts at `self.from`.
    fn slice_end(&self) -> Vec<u8> {
        let suffix = &self.from[self.prefix.len().min(self.from.len())..];
        let last = hash_position(suffix).saturating_add(self.width - 1);
        let to = match last {
            p if p >= SPACE - 1 => return self.end.clone(),
            p => [self.prefix.as_slice(), format!("{:08x}", p + 1).as_bytes()].concat(),
        };
        // Never behind `from` (a key whose suffix is not a hash).
        if to <= self.from {
            self.end.clone()
        } else {
            to
        }
    }

    pub(super) async fn next(
        &mut self,
        conn: &EtcdConn,
    ) -> Result<Option<Vec<KeyValue>>, EtcdError> {
        if self.done {
            return Ok(None);
        }
        let to = self.slice_end();
        let mut opts = GetOptions::new()
            .with_range(to.clone())
            .with_limit(PAGE as i64);
        if self.keys_only {
            opts = opts.with_keys_only();
        }
        if self.pinned && self.revision > 0 {
            opts = opts.with_revision(self.revision);
        }
        let mut kv = conn.client().kv_client();
        let call = kv.get(self.from.clone(), Some(opts));
        let mut resp = conn.call("Range", call).await?;
        if self.revision == 0 || !self.pinned {
            self.revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        }
        let more = resp.more();
        let kvs = resp.take_kvs();
        match kvs.last() {
            Some(last) if more => {
                self.from = last.key().to_vec();
                self.from.push(0);
                self.width = (self.width / 2).max(1);
            }
            _ if to >= self.end => self.done = true,
            _ => {
                self.from = to;
                if kvs.len() < PAGE / 4 {
                    self.width = (self.width * 2).min(SPACE);
                }
            }
        }
        Ok(Some(kvs))
    }
}

/// The place of a hash suffix in the hash space: its first 32 bits.
pub(super) fn hash_position(suffix: &[u8]) -> u64 {
    std::str::from_utf8(suffix.get(..8).unwrap_or(b"0"))
        .ok()
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held() -> (Vec<u8>, Vec<u8>) {
        (b"/p/held/".to_vec(), b"/p/held0".to_vec())
    }

    #[test]
    fn a_pass_goes_on_where_it_stopped_and_the_next_waits_its_turn() {
        let mut sweep = Sweep::default();
        let every = Duration::from_secs(3600);
        let mut pages = sweep.begin(held(), every).expect("the first pass");
        pages.resume_after(b"/p/held/7f");
        sweep.keep(pages);
        let pages = sweep.begin(held(), every).expect("the pass under way");
        assert_eq!(pages.from, b"/p/held/7f\0");
        assert!(
            !pages.pinned,
            "a paced pass reads each page at the newest revision"
        );
        // Over: not kept, and no new pass before `every`.
        let mut pages = pages;
        pages.done = true;
        sweep.keep(pages);
        assert!(sweep.begin(held(), every).is_none());
        let again = sweep.begin(held(), Duration::ZERO).expect("a new pass");
        assert_eq!(again.from, held().0);
    }

    #[test]
    fn resuming_after_the_last_key_ends_the_pass() {
        let mut pages = Pages::new(held(), true);
        pages.resume_after(b"/p/held/ff");
        assert!(!pages.done);
        pages.resume_after(b"/p/held0");
        assert!(pages.done);
    }
}
