//! The load scenarios: router scenarios driven through its HTTP API
//! ([`lifecycle`], [`contended`], [`hold`]) and the etcd [`baselines`] they
//! are compared against.

pub mod baselines;
pub mod contended;
pub mod hold;
pub mod lifecycle;
