//! The refusals more than one layer gives: a caller denied what it asked
//! for ([`Denied`], 403) and a caller past a rate or a bound that frees up
//! with time ([`RateLimited`], 429). The principals' checks (`auth`) and
//! the lock operations (`locks`) both refuse with these, each wrapping
//! them in its own error, so that `http::error` maps each kind once: the
//! same status, code, message and `Retry-After` whichever layer refused.
//! A leaf: it imports nothing of the crate.

use std::time::Duration;

/// A known caller outside what it may do: a name outside its prefixes, a
/// lock of another principal, a quota reached. The message says which.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Denied(pub String);

impl Denied {
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// Past a rate (a principal's or a clientId's acquires per second) or a
/// bound that frees up with time (the waiting acquires a router holds).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct RateLimited {
    /// What was passed, for the caller.
    pub reason: String,
    /// When a retry may pass; answered as `Retry-After`, in whole seconds
    /// and at least one.
    pub retry_after: Duration,
}
