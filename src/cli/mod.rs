//! The `lockrouter` subcommands besides `serve`: [`exec`] runs a command
//! while holding a lock (through the client crate), [`plan`] sizes a
//! deployment with the capacity model ([`capacity`]), [`ops`] makes the
//! operator's calls (inspect, locks, client, ring, status, force-release,
//! reload, bump-epoch) over one [`conn`] and prints their answers as
//! [`output`] says (tables from [`views`]). [`target`]: the connection
//! flags every command that calls a router shares.

pub mod capacity;
pub mod conn;
pub mod exec;
pub mod ops;
pub mod output;
pub mod plan;
pub mod target;
pub mod views;
