//! [`LockInfo`]: what the router tells anyone about a name (its inspect
//! endpoint), as a typed value. A leaf: it knows the answer's fields and
//! nothing of the client.

use std::time::{Duration, SystemTime};

use serde::Deserialize;

/// A name as [`Client::inspect`](crate::Client::inspect) found it: the
/// router's inspect answer, plus whether this client holds it.
///
/// Times are the router's wall clock, for people and planning: never judge
/// a lock's safety by them (a [`Lock`](crate::Lock) has its own validity,
/// on this process's monotonic clock).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct LockInfo {
    /// The name asked about.
    pub name: String,
    /// Whether a lock key exists for it. A free name may still refuse an
    /// acquire while others are queued or a lost holder's lock-delay runs.
    pub held: bool,
    /// The holding grant's fencing token.
    pub fencing_token: Option<u64>,
    /// When the holder's lease ends unless renewed (RFC 3339, router clock).
    pub expires_at: Option<String>,
    /// When the lock was granted (RFC 3339, granting router's clock).
    pub acquired_at: Option<String>,
    /// What the holder attached at acquire, if anything.
    pub metadata: Option<serde_json::Value>,
    /// Acquires queued for the name (0 when none).
    #[serde(default)]
    pub waiters: u64,
    /// The holder's client id: shown only to admin callers (and to any
    /// caller on loopback of a router with no admin guard).
    #[serde(rename = "clientId")]
    pub holder: Option<String>,
    /// The holder's principal, for admin callers, when it has one.
    pub principal: Option<String>,
    /// The shard that owns the name.
    pub shard: String,
    /// True when a `Lock` of this client holds the name's grant and has not
    /// lost it (like redis-py's `owned()`).
    #[serde(skip)]
    pub mine: bool,
}

impl LockInfo {
    /// Time left before the holder's lease ends unless renewed, by this
    /// machine's wall clock against the router's (zero when free or past).
    /// For display and planning only.
    pub fn time_left(&self) -> Duration {
        self.expires_at
            .as_deref()
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            .and_then(|t| t.duration_since(SystemTime::now()).ok())
            .unwrap_or(Duration::ZERO)
    }
}
