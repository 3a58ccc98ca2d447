//! The client's error type: one enum for every way a call can fail, so
//! callers can tell "someone else holds it" from "the lock was lost" from
//! "the router said no" from "the router could not be reached".

use std::fmt;
use std::time::Duration;

/// Why a lock can no longer be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LostReason {
    /// The router reported the lock gone: its lease ran out, or someone
    /// else released it (another `Client` under the same client id, say).
    Expired,
    /// The router reported that another holder has the name now.
    Stolen,
    /// The client's own clock passed the lock's validity without a
    /// confirmed renewal (router unreachable, shard unavailable, or the
    /// process was paused). The lease may or may not still exist; the client
    /// can no longer prove it does.
    Unconfirmed,
    /// The router refused to renew the lock (for example, its lockId names a
    /// shard the router no longer knows).
    Refused,
    /// This client released it or dropped it, through this `Lock` or
    /// another `Lock` of the same grant.
    Released,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::Expired => "expired",
            LostReason::Stolen => "stolen by another holder",
            LostReason::Unconfirmed => "validity ran out without a confirmed renewal",
            LostReason::Refused => "the router refused to renew it",
            LostReason::Released => "released",
        })
    }
}

/// Everything a client call can fail with.
///
/// ```
/// use lockrouter_client::{Error, LostReason};
///
/// fn describe(e: &Error) -> &'static str {
///     match e {
///         Error::NotAcquired { .. } => "busy: try later",
///         Error::Lost { reason: LostReason::Stolen, .. } => "someone else holds it now",
///         Error::Lost { .. } => "stop touching the resource",
///         Error::Router { status: 503, .. } | Error::Transport(_) => "retry",
///         Error::Router { .. } | Error::Config(_) => "fix the request",
///     }
/// }
/// assert_eq!(describe(&Error::Transport("refused".into())), "retry");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Another client holds the lock (returned by helpers that need the
    /// lock, such as [`Client::with_lock`](crate::Client::with_lock);
    /// [`Client::acquire`](crate::Client::acquire) answers `Ok(None)`).
    #[error("lock {name:?} is held by another client")]
    NotAcquired { name: String },
    /// The lock was lost while work was running under it; the work was cut
    /// short. From [`Lock::release`](crate::Lock::release): the lock was
    /// lost and its grant has passed to a newer `Lock` of this client.
    #[error("lock {name:?} was lost: {reason}")]
    Lost { name: String, reason: LostReason },
    /// The router answered with an error (`status` and its stable `code`),
    /// and, for a refusal to try again later, how much later.
    #[error("router answered {status} {code}: {message}")]
    Router {
        status: u16,
        code: String,
        message: String,
        /// How long the router asked the caller to wait before sending the
        /// request again: its `Retry-After` header, which it sends with 503
        /// `overloaded` and `shard_unavailable`, 429 `rate_limited` and 504
        /// `timeout`. Only whole seconds (`Retry-After: 1`) are read; an
        /// answer without the header, or with any other form of it (an
        /// HTTP date included), gives `None`. Capped at an hour.
        retry_after: Option<Duration>,
    },
    /// The router could not be reached, or did not answer in time.
    #[error("cannot reach the router: {0}")]
    Transport(String),
    /// The client was set up or called wrongly (bad URL, zero TTL, no tokio
    /// runtime).
    #[error("invalid client use: {0}")]
    Config(String),
}

impl Error {
    /// True for errors worth retrying later with the same request: transport
    /// failures, 408 (the request was not read in time), 429, 503 (shard
    /// unavailable), 504 and other 5xx answers.
    ///
    /// ```
    /// use lockrouter_client::Error;
    /// assert!(Error::Transport("timeout".into()).is_retryable());
    /// let slow = Error::Router {
    ///     status: 408,
    ///     code: "timeout".into(),
    ///     message: String::new(),
    ///     retry_after: None,
    /// };
    /// assert!(slow.is_retryable());
    /// assert!(!Error::NotAcquired { name: "x".into() }.is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Transport(_) => true,
            Error::Router { status, .. } => matches!(*status, 408 | 429) || *status >= 500,
            _ => false,
        }
    }

    /// How long the router asked to wait before trying again (see
    /// [`Error::Router`]'s `retry_after`); `None` for an answer without
    /// one and for every other variant. The client waits at least this
    /// long before it repeats a release itself (a renewal only where its
    /// lock's validity leaves room); a caller retrying an acquire should
    /// wait as long too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use lockrouter_client::Error;
    /// let busy = Error::Router {
    ///     status: 503,
    ///     code: "overloaded".into(),
    ///     message: "retry after a second".into(),
    ///     retry_after: Some(Duration::from_secs(1)),
    /// };
    /// assert_eq!(busy.retry_after(), Some(Duration::from_secs(1)));
    /// assert_eq!(Error::Transport("refused".into()).retry_after(), None);
    /// ```
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Router { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}
