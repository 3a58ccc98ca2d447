//! Listing held locks for operators: a page of the locks held across every
//! shard, in a stable order (shard name, then the name's hash), resumed by
//! a cursor; and what one client holds. Both read etcd (range reads, never
//! a raft write) and are admin routes: they cost in proportion to what they
//! scan, which each bounds.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use futures::{StreamExt, TryStreamExt};

use super::*;
use crate::shard::keys::{LockValue, Stored};
use crate::token::fencing;

/// Most lock keys one page reads, however few match its prefix: a page of
/// a rare prefix among a million locks stays one bounded step, and says
/// where to go on.
pub const SCAN_PER_PAGE: usize = 5_000;
/// Keys read per range request.
const CHUNK: usize = 1_000;
/// Session leases whose time left one page asks etcd for at once.
const TTL_READS_IN_FLIGHT: usize = 16;
/// Most locks a client view lists.
pub const CLIENT_MAX_LOCKS: usize = 10_000;

/// A held lock as an operator sees it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub name: String,
    pub shard: String,
    pub fencing_token: u64,
    /// The holder (principal and clientId, see [`split_holder`]).
    pub holder: String,
    pub ttl_secs: u32,
    pub lease: i64,
    pub acquired_at: Option<SystemTime>,
    pub metadata: Option<serde_json::Value>,
    /// When its session lease ends unless renewed, as etcd said while
    /// listing (whole seconds, rounded down: never later than the truth).
    pub expires: Option<Expiry>,
}

/// One page of held locks, and where the next one starts.
pub struct Page {
    pub locks: Vec<Listed>,
    /// `None` once every shard was read to its end.
    pub next: Option<String>,
}

/// Where a listing stands: after lock key `after` (its hash suffix) of
/// `shard`. Encoded as base64url of `shard NUL suffix`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cursor {
    shard: String,
    after: Vec<u8>,
}

impl Cursor {
    fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode([self.shard.as_bytes(), &[0], &self.after].concat())
    }

    fn decode(s: &str) -> Result<Self, LockError> {
        let bad = || invalid("cursor is not one this router gave");
        let raw = URL_SAFE_NO_PAD.decode(s).map_err(|_| bad())?;
        let at = raw.iter().position(|b| *b == 0).ok_or_else(bad)?;
        let shard = String::from_utf8(raw[..at].to_vec()).map_err(|_| bad())?;
        let after = raw[at + 1..].to_vec();
        let hash = after.len() == 32 && after.iter().all(u8::is_ascii_hexdigit);
        if shard.is_empty() || !(after.is_empty() || hash) {
            return Err(bad());
        }
        Ok(Self { shard, after })
    }
}

/// What one client holds: its locks, and the session leases they ride on.
pub struct ClientView {
    pub locks: Vec<Listed>,
    pub sessions: Vec<SessionView>,
    /// More than [`CLIENT_MAX_LOCKS`] locks: the list is cut.
    pub truncated: bool,
}

/// A session lease of a client on a shard.
pub struct SessionView {
    pub shard: String,
    pub lease: i64,
    pub ttl_secs: u32,
    /// When etcd ends it unless renewed, as far as the router knows now.
    pub expires: Expiry,
    pub locks: usize,
}

impl Locks {
    pub async fn list_locks(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, LockError> {
        self.active.list_locks(prefix, cursor, limit).await
    }

    /// What `holder` holds, and its sessions, on every shard.
    pub async fn client_view(&self, holder: &Holder) -> Result<ClientView, LockError> {
        self.active.client_view(holder.as_str()).await
    }
}

impl Active {
    /// Up to `limit` held locks whose names start with `prefix`, after
    /// `cursor`, each with the time its session lease has left. Every lock
    /// held from before the first page to after the last is listed exactly
    /// once; one granted or released meanwhile may or may not be.
    pub async fn list_locks(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, LockError> {
        let mut page = self.scan_locks(prefix, cursor, limit).await?;
        self.read_expiries(&mut page.locks).await?;
        Ok(page)
    }

    /// Sets each lock's expiry: one LeaseTimeToLive (a read on the leader,
    /// no raft write) per distinct session lease, the locks of one client
    /// and TTL sharing theirs, a few at a time.
    async fn read_expiries(&self, locks: &mut [Listed]) -> Result<(), LockError> {
        let mut leases: Vec<(String, i64)> =
            locks.iter().map(|l| (l.shard.clone(), l.lease)).collect();
        leases.sort_unstable();
        leases.dedup();
        let shards = self.router.all_shards();
        let reads = leases.into_iter().map(|(name, lease)| {
            let shard = shards.iter().find(|s| s.name() == name).cloned();
            async move {
                let Some(shard) = shard else {
                    return Ok((name, lease, None));
                };
                let sent = Instant::now();
                let left = shard.time_to_live(lease).await?;
                let expires = Expiry(sent + Duration::from_secs(left as u64));
                Ok::<_, LockError>((name, lease, Some(expires)))
            }
        });
        let read: Vec<_> = futures::stream::iter(reads)
            .buffer_unordered(TTL_READS_IN_FLIGHT)
            .try_collect()
            .await?;
        for l in locks {
            l.expires = read
                .iter()
                .find(|(shard, lease, _)| *shard == l.shard && *lease == l.lease)
                .and_then(|(_, _, e)| *e);
        }
        Ok(())
    }

    async fn scan_locks(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, LockError> {
        let cursor = cursor.map(Cursor::decode).transpose()?;
        let mut shards = self.router.all_shards();
        shards.sort_by(|a, b| a.name().cmp(b.name()));
        shards.dedup_by(|a, b| a.name() == b.name());
        let mut locks = Vec::new();
        let mut scanned = 0;
        for shard in shards {
            let mut after = match &cursor {
                Some(c) if shard.name() < c.shard.as_str() => continue,
                Some(c) if shard.name() == c.shard && !c.after.is_empty() => Some(c.after.clone()),
                _ => None,
            };
            check_identity(&shard)?;
            loop {
                if locks.len() >= limit || scanned >= SCAN_PER_PAGE {
                    let next = Cursor {
                        shard: shard.name().to_string(),
                        after: after.unwrap_or_default(),
                    };
                    return Ok(Page {
                        locks,
                        next: Some(next.encode()),
                    });
                }
                // Never 0: etcd reads a limit of 0 as no limit.
                let want = (limit - locks.len())
                    .min(SCAN_PER_PAGE - scanned)
                    .min(CHUNK);
                let (kvs, next) = shard.lock_page(after.as_deref(), want as i64).await?;
                // Empty slices count too, so a page's reads stay bounded.
                scanned += kvs.len().max(1);
                for kv in &kvs {
                    if let Some(l) = listed(&shard, kv).filter(|l| l.name.starts_with(prefix)) {
                        locks.push(l);
                    }
                }
                match next {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
        }
        Ok(Page { locks, next: None })
    }

    /// The locks `holder` holds on every shard, and the session leases they
    /// ride on with the time etcd gives each. Reads every lock key (with
    /// values) of every shard: an operator's call, not a worker's.
    pub async fn client_view(&self, holder: &str) -> Result<ClientView, LockError> {
        let mut view = ClientView {
            locks: Vec::new(),
            sessions: Vec::new(),
            truncated: false,
        };
        for shard in self.router.all_shards() {
            check_identity(&shard)?;
            let mut mine = Vec::new();
            // Slice by slice (see `Shard::lock_page`): a read to the end of
            // the range would cost every key after it on etcd 3.4.
            let mut after: Option<Vec<u8>> = None;
            loop {
                let (kvs, next) = shard.lock_page(after.as_deref(), CHUNK as i64).await?;
                let found = kvs.iter().filter_map(|kv| listed(&shard, kv));
                mine.extend(found.filter(|l| l.holder == holder));
                match next {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
            let mut leases: Vec<(i64, u32)> = mine.iter().map(|l| (l.lease, l.ttl_secs)).collect();
            leases.sort_unstable();
            leases.dedup();
            for (lease, ttl_secs) in leases {
                let sent = Instant::now();
                let left = shard.time_to_live(lease).await?;
                let expires = Expiry(sent + Duration::from_secs(left as u64));
                for l in mine.iter_mut().filter(|l| l.lease == lease) {
                    l.expires = Some(expires);
                }
                view.sessions.push(SessionView {
                    shard: shard.name().to_string(),
                    lease,
                    ttl_secs,
                    expires,
                    locks: mine.iter().filter(|l| l.lease == lease).count(),
                });
            }
            view.locks.extend(mine);
        }
        view.locks.sort_by(|a, b| a.name.cmp(&b.name));
        if view.locks.len() > CLIENT_MAX_LOCKS {
            view.locks.truncate(CLIENT_MAX_LOCKS);
            view.truncated = true;
        }
        Ok(view)
    }
}

/// A lock key read with its value; `None` for a value it cannot read.
fn listed(shard: &Shard, kv: &Stored) -> Option<Listed> {
    let value: LockValue = serde_json::from_slice(kv.value()).ok()?;
    Some(Listed {
        fencing_token: fencing::token(value.epoch, kv.create_revision())?,
        name: value.name,
        shard: shard.name().to_string(),
        holder: value.client,
        ttl_secs: value.ttl,
        lease: kv.lease(),
        acquired_at: Some(value.at)
            .filter(|ms| *ms > 0)
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
        metadata: value.meta,
        expires: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_made_up_ones_are_refused() {
        let c = Cursor {
            shard: "shard-b".into(),
            after: hex::encode([7u8; 16]).into_bytes(),
        };
        assert_eq!(Cursor::decode(&c.encode()).unwrap(), c);
        let start = Cursor {
            shard: "c".into(),
            after: Vec::new(),
        };
        assert_eq!(Cursor::decode(&start.encode()).unwrap(), start);
        for bad in ["", "!!", "AAAA", &URL_SAFE_NO_PAD.encode(b"a\0short")] {
            assert!(Cursor::decode(bad).is_err(), "{bad:?}");
        }
    }
}
