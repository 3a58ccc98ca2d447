//! Paged range reads over a shard's lock keys, held records and
//! lock-delays, each pinned to one revision: counts for metrics, the moved
//! names a migration's close waits for, and the lost holders the sweep
//! turns into lock-delays. None is a raft write.

use std::time::{Duration, Instant};

use etcd_client::{GetOptions, KeyValue};

use super::conn::EtcdError;
use super::keys::{NameHash, Stored};
use super::{NameKeys, Shard};

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

impl Shard {
    /// The hex name hashes of the keys in `[start, end)` (lock keys, held
    /// records or lock-delays) whose names satisfy `wanted`, reading every
    /// key at one revision, a page at a time (no raft writes).
    pub async fn hashes_where(
        &self,
        (start, end): (Vec<u8>, Vec<u8>),
        wanted: &mut impl FnMut(&str) -> bool,
    ) -> Result<Vec<Vec<u8>>, EtcdError> {
        let mut found = Vec::new();
        let prefix = start.len();
        self.scan((start, end), |kvs| {
            for kv in kvs {
                if name_of(kv.value()).is_some_and(|n| wanted(&n)) {
                    found.push(kv.key()[prefix.min(kv.key().len())..].to_vec());
                }
            }
        })
        .await?;
        Ok(found)
    }

    /// Reads every key in `[start, end)` at one revision, a page at a time,
    /// handing each page to `page`. Returns the revision read at.
    pub async fn scan(
        &self,
        range: (Vec<u8>, Vec<u8>),
        mut page: impl FnMut(&[KeyValue]),
    ) -> Result<i64, EtcdError> {
        let mut pages = Pages::new(range, false);
        while let Some(kvs) = pages.next(self).await? {
            page(&kvs);
        }
        Ok(pages.revision)
    }

    /// Held records without their lock key: holders lost (their lease
    /// ended) whose names nobody asked for since. Reads keys only, a page of
    /// held records and the lock keys of the same span at one revision, so
    /// a sweep costs two key-only ranges per thousand held locks.
    pub async fn orphaned_held(&self) -> Result<Vec<Stored>, EtcdError> {
        let mut pages = Pages::new(self.keys.held_range(), true);
        let mut orphans = Vec::new();
        while let Some(page) = pages.next(self).await? {
            orphans.extend(self.orphans_of(page, pages.revision).await?);
        }
        Ok(orphans)
    }

    /// The next page of the paced sweep (`Sweep`): the held records of one
    /// page without their lock key, or `None` when the pass is over. The
    /// lock-key side comes from the lock-key cache when it has applied the
    /// page's revision, so a page usually costs one key-only range.
    pub(super) async fn next_orphans(
        &self,
        pages: &mut Pages,
    ) -> Result<Option<Vec<Stored>>, EtcdError> {
        let Some(page) = pages.next(self).await? else {
            return Ok(None);
        };
        Ok(Some(self.orphans_of(page, pages.revision).await?))
    }

    /// The held records of `page` (read at `revision`) without a lock key:
    /// as the lock-key cache knows them once it has applied `revision`, else
    /// as a key-only range of the same span at `revision` says. A candidate
    /// is only that: the txn that converts it compares the lock key's
    /// absence and the record's mod revision itself.
    async fn orphans_of(
        &self,
        page: Vec<etcd_client::KeyValue>,
        revision: i64,
    ) -> Result<Vec<Stored>, EtcdError> {
        let prefix = self.keys.held_range().0.len();
        let (Some(first), Some(last)) = (page.first(), page.last()) else {
            return Ok(Vec::new());
        };
        let hashes: Option<Vec<NameHash>> = page
            .iter()
            .map(|kv| hash_of_hex(&kv.key()[prefix.min(kv.key().len())..]))
            .collect();
        if let Some(present) = hashes.and_then(|h| self.cache.present(&h, revision)) {
            return Ok(page
                .into_iter()
                .zip(present)
                .filter(|(_, held)| !held)
                .map(|(kv, _)| Stored::from(kv))
                .collect());
        }
        // The lock keys of this page's span, at the same revision.
        let locks_prefix = self.keys.locks_range().0.len();
        let mut end = self.lock_key_of_held(last.key());
        end.push(0);
        let opts = GetOptions::new()
            .with_range(end)
            .with_keys_only()
            .with_revision(revision);
        let mut kv = self.conn.client().kv_client();
        let start = self.lock_key_of_held(first.key());
        let locks = self
            .conn
            .call("Range", kv.get(start, Some(opts)))
            .await?
            .take_kvs();
        let held: std::collections::HashSet<&[u8]> =
            locks.iter().map(|l| &l.key()[locks_prefix..]).collect();
        Ok(page
            .into_iter()
            .filter(|h| !held.contains(&h.key()[prefix..]))
            .map(Stored::from)
            .collect())
    }

    fn lock_key_of_held(&self, held: &[u8]) -> Vec<u8> {
        let (start, _) = self.keys.held_range();
        let (locks, _) = self.keys.locks_range();
        let mut key = locks;
        key.extend_from_slice(&held[start.len().min(held.len())..]);
        key
    }

    /// The name keys of the name a held record belongs to.
    pub fn keys_of_held(&self, held: &Stored) -> NameKeys {
        let (start, _) = self.keys.held_range();
        let hex = &held.key()[start.len().min(held.key().len())..];
        let mut hash = [0u8; 16];
        for (i, byte) in hash.iter_mut().enumerate() {
            let pair = hex
                .get(2 * i..2 * i + 2)
                .and_then(|p| std::str::from_utf8(p).ok());
            *byte = pair
                .and_then(|p| u8::from_str_radix(p, 16).ok())
                .unwrap_or(0);
        }
        self.name_keys(&hash)
    }

    /// Up to `limit` lock keys, with values, in key order, after the lock
    /// key of `after` (a 32-hex-digit hash suffix; from the first without
    /// it), and the suffix to go on after (`None`: no lock key follows).
    /// One range read, no raft write.
    ///
    /// The read covers only a slice of the hash space after `after`, sized
    /// for about `4 * limit` keys by the lock-key cache's count: etcd 3.4
    /// collects every revision of a range before it applies the limit, so
    /// a read to the end of a million keys costs the million. The slice
    /// may hold fewer than `limit` keys, even none; the suffix returned
    /// then points past it.
    pub async fn lock_page(
        &self,
        after: Option<&[u8]>,
        limit: i64,
    ) -> Result<(Vec<Stored>, Option<Vec<u8>>), EtcdError> {
        let (start, end) = self.keys.locks_range();
        let held = self.cache.len().unwrap_or(1_000_000).max(1) as u64;
        let width = (SPACE.saturating_mul(4 * limit.max(1) as u64) / held).max(1);
        let first = after.map_or(0, hash_position);
        // The last position the slice covers (`SPACE - 1`: to the end).
        let last = first.saturating_add(width - 1).min(SPACE - 1);
        let from = match after {
            Some(suffix) => [start.as_slice(), suffix, &[0]].concat(),
            None => start.clone(),
        };
        let to = match last {
            p if p >= SPACE - 1 => end,
            p => [start.as_slice(), format!("{:08x}", p + 1).as_bytes()].concat(),
        };
        let opts = GetOptions::new().with_range(to).with_limit(limit);
        let mut kv = self.conn.client().kv_client();
        let mut resp = self.conn.call("Range", kv.get(from, Some(opts))).await?;
        let more = resp.more();
        let kvs = resp.take_kvs();
        let next = match kvs.last() {
            Some(kv) if more => Some(self.lock_suffix(kv.key()).to_vec()),
            _ if last >= SPACE - 1 => None,
            // The slice is read: go on after its last possible key.
            _ => Some(format!("{last:08x}{}", "f".repeat(24)).into_bytes()),
        };
        Ok((kvs.into_iter().map(Stored::from).collect(), next))
    }

    /// The hex hash suffix of a lock key.
    pub fn lock_suffix<'k>(&self, key: &'k [u8]) -> &'k [u8] {
        &key[self.keys.locks_range().0.len().min(key.len())..]
    }

    /// Number of keys starting with `prefix` (a count-only range).
    pub async fn count_prefix(&self, prefix: &[u8]) -> Result<i64, EtcdError> {
        let mut kv = self.conn.client().kv_client();
        let opts = GetOptions::new().with_prefix().with_count_only();
        Ok(self
            .conn
            .call("Range", kv.get(prefix, Some(opts)))
            .await?
            .count())
    }

    /// Number of lock keys on the shard (a count-only range: no values read).
    pub async fn count_locks(&self) -> Result<i64, EtcdError> {
        let (start, end) = self.keys.locks_range();
        let mut kv = self.conn.client().kv_client();
        let opts = GetOptions::new().with_range(end).with_count_only();
        Ok(self
            .conn
            .call("Range", kv.get(start, Some(opts)))
            .await?
            .count())
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
pub(super) struct Pages {
    /// The range's start: its keys' common prefix.
    prefix: Vec<u8>,
    from: Vec<u8>,
    end: Vec<u8>,
    keys_only: bool,
    /// Every page at the first page's revision (a scan), or each at the
    /// newest (a paced sweep, whose pass may outlive compaction).
    pinned: bool,
    /// The revision of the last page read; 0 until the first is read.
    revision: i64,
    /// Positions of the hash space (see [`hash_position`]) the next read
    /// covers.
    width: u64,
    done: bool,
}

/// Positions in the hash space: the first 32 bits of a hash.
const SPACE: u64 = 1 << 32;
/// Keys a page reads.
const PAGE: usize = 1_000;

impl Pages {
    fn new((start, end): (Vec<u8>, Vec<u8>), keys_only: bool) -> Self {
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

    async fn next(&mut self, shard: &Shard) -> Result<Option<Vec<KeyValue>>, EtcdError> {
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
        let mut kv = shard.conn.client().kv_client();
        let call = kv.get(self.from.clone(), Some(opts));
        let mut resp = shard.conn.call("Range", call).await?;
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
fn hash_position(suffix: &[u8]) -> u64 {
    std::str::from_utf8(suffix.get(..8).unwrap_or(b"0"))
        .ok()
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .unwrap_or(0)
}

/// The name hash a key's 32-hex-digit suffix spells.
fn hash_of_hex(hex: &[u8]) -> Option<NameHash> {
    let mut hash = NameHash::default();
    hex::decode_to_slice(hex, &mut hash).ok()?;
    Some(hash)
}

/// The name recorded in a lock key, held record or lock-delay.
fn name_of(value: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        name: String,
    }
    serde_json::from_slice::<Named>(value).ok().map(|n| n.name)
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

    #[test]
    fn a_held_key_suffix_is_its_name_hash() {
        let hash = crate::shard::keys::name_hash("order-42");
        assert_eq!(hash_of_hex(hex::encode(hash).as_bytes()), Some(hash));
        assert_eq!(hash_of_hex(b"not hex"), None);
    }
}
