//! The `lockrouter` subcommands besides `serve`: [`exec`] runs a command
//! while holding a lock (through the client crate), [`plan`] sizes a
//! deployment with the capacity model ([`capacity`]), [`ops`] makes the
//! operator's calls (inspect, force-release, ring, reload).

pub mod capacity;
pub mod exec;
pub mod ops;
pub mod plan;
