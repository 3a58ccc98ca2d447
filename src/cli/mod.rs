//! The `lockrouter` subcommands besides `serve`: [`exec`] runs a command
//! while holding a lock (through the client crate), [`plan`] sizes a
//! deployment with the capacity model ([`capacity`]), [`ops`] makes the
//! operator's calls (inspect, force-release, ring, reload). [`target`]:
//! the connection flags every command that calls a router shares.

pub mod capacity;
pub mod exec;
pub mod ops;
pub mod plan;
pub mod target;
