//! The load scenarios: router scenarios driven through its HTTP API
//! ([`lifecycle`], [`contended`], [`contended_wait`], [`hold`],
//! [`rebalance`], [`overload`]), the etcd [`baselines`] they are compared against, the
//! [`clients`] acquires are made for, and the session [`warmup`] before a
//! measured window.

pub mod baselines;
pub mod clients;
pub mod contended;
pub mod contended_wait;
pub mod hold;
pub mod lifecycle;
pub mod overload;
pub mod rebalance;
pub mod warmup;
