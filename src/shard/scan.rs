//! Paged range reads over a shard's lock keys, held records and
//! lock-delays, each pinned to one revision: counts for metrics, the moved
//! names a migration's close waits for, and the lost holders the sweep
//! turns into lock-delays. None is a raft write.

use etcd_client::{GetOptions, KeyValue};

use super::conn::EtcdError;
use super::keys::Stored;
use super::{NameKeys, Shard};

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
        let prefix = self.keys.held_range().0.len();
        let locks_prefix = self.keys.locks_range().0.len();
        let mut pages = Pages::new(self.keys.held_range(), true);
        let mut orphans = Vec::new();
        while let Some(page) = pages.next(self).await? {
            let (Some(first), Some(last)) = (page.first(), page.last()) else {
                continue;
            };
            // The lock keys of this page's span, at the same revision.
            let mut end = self.lock_key_of_held(last.key());
            end.push(0);
            let opts = GetOptions::new()
                .with_range(end)
                .with_keys_only()
                .with_revision(pages.revision);
            let mut kv = self.conn.client().kv_client();
            let start = self.lock_key_of_held(first.key());
            let locks = self
                .conn
                .call("Range", kv.get(start, Some(opts)))
                .await?
                .take_kvs();
            let held: std::collections::HashSet<&[u8]> =
                locks.iter().map(|l| &l.key()[locks_prefix..]).collect();
            orphans.extend(
                page.into_iter()
                    .filter(|h| !held.contains(&h.key()[prefix..]))
                    .map(Stored::from),
            );
        }
        Ok(orphans)
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
struct Pages {
    /// The range's start: its keys' common prefix.
    prefix: Vec<u8>,
    from: Vec<u8>,
    end: Vec<u8>,
    keys_only: bool,
    /// 0 until the first page is read.
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
            revision: 0,
            width: SPACE,
            done: false,
        }
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
        if self.revision > 0 {
            opts = opts.with_revision(self.revision);
        }
        let mut kv = shard.conn.client().kv_client();
        let call = kv.get(self.from.clone(), Some(opts));
        let mut resp = shard.conn.call("Range", call).await?;
        if self.revision == 0 {
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

/// The name recorded in a lock key, held record or lock-delay.
fn name_of(value: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        name: String,
    }
    serde_json::from_slice::<Named>(value).ok().map(|n| n.name)
}
