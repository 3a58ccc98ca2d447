//! Placement: which shard owns a lock name, and how that changes.
//!
//! - [`ring`]: consistent hashing of names onto shards, with a fingerprint
//!   of everything that decides placement.
//! - [`topology`]: a router's shards, their states, and whether it may
//!   grant on each (the ring it serves, and any open migration).
//! - [`monitor`]: the task that reads what every shard records and acts on
//!   it (initialise, verify identities, follow and close migrations).

pub mod monitor;
pub mod ring;
pub mod topology;
