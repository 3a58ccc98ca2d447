//! Paged range reads over a shard's lock keys, held records and
//! lock-delays, each pinned to one revision: counts for metrics, the moved
//! names a migration's close waits for, and the lost holders the sweep
//! turns into lock-delays. None is a raft write.

use etcd_client::{GetOptions, KeyValue};

use super::conn::EtcdError;
use super::keys::{hash_of_hex, NameHash, Stored};
use super::pages::{hash_position, Pages, SPACE};
use super::{NameKeys, Shard};
use crate::config::LockDelay;

impl Shard {
    /// How many names satisfying `wanted` are still on the shard: held,
    /// lost without a lock-delay set yet, or waiting one out (a migration's
    /// moved names on their previous shard). Lost holders among them get
    /// their lock-delay now (with lock-delay off, are forgotten) rather
    /// than at the next sweep, so that whoever waits for these names to go
    /// waits no longer than the delay itself.
    pub async fn names_left(
        &self,
        mut wanted: impl FnMut(&str) -> bool,
        lock_delay: LockDelay,
    ) -> Result<i64, EtcdError> {
        let k = &self.keys;
        let locks = self.hashes_where(k.locks_range(), &mut wanted).await?;
        let held = self.hashes_where(k.held_range(), &mut wanted).await?;
        let delays = self.hashes_where(k.delay_range(), &mut wanted).await?;
        // A held record without its lock key is a lost holder.
        if held.iter().any(|h| !locks.contains(h)) {
            self.sweep_lost(lock_delay).await;
        }
        // A held lock has a lock key and a held record: count names, not keys.
        let names: std::collections::HashSet<Vec<u8>> =
            locks.into_iter().chain(held).chain(delays).collect();
        Ok(names.len() as i64)
    }

    /// The hex name hashes of the keys in `[start, end)` (lock keys, held
    /// records or lock-delays) whose names satisfy `wanted`, reading every
    /// key at one revision, a page at a time (no raft writes).
    async fn hashes_where(
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
        while let Some(kvs) = pages.next(&self.conn).await? {
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
        while let Some(page) = pages.next(&self.conn).await? {
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
        let Some(page) = pages.next(&self.conn).await? else {
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
        self.name_keys(&self.keys.hash_of_held(held.key()))
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

/// The name recorded in a lock key, held record or lock-delay.
fn name_of(value: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        name: String,
    }
    serde_json::from_slice::<Named>(value).ok().map(|n| n.name)
}
