//! The load scenarios: router scenarios driven through its HTTP API
//! ([`lifecycle`], [`contended`], [`contended_wait`], [`hold`],
//! [`rebalance`]) and the etcd [`baselines`] they
//! are compared against.

pub mod baselines;
pub mod contended;
pub mod contended_wait;
pub mod hold;
pub mod lifecycle;
pub mod rebalance;
