//! The process harness shared by lockrouter's integration tests (`tests/`)
//! and its load tests (`loadtest/`). What they run is real: etcd processes,
//! routers in-process or as the `lockrouter` binary, client programs, each
//! on free loopback ports with its data in a temp dir. Every value owns what
//! it started, and dropping it kills and reaps the process and removes the
//! dir, so a failed test or an interrupted run leaves nothing behind.
//!
//! Tests call the panicking forms (`EtcdCluster::start`,
//! `RouterProcess::start`): a harness that cannot start is a failed test,
//! and the panic carries the process's log. The load tests call the
//! builders, which return an [`Error`] instead.
//!
//! # Layout
//! - [`etcd`]: etcd clusters of one or more members, and faults on them;
//!   optionally with TLS (client certificates too) and etcd auth.
//! - [`pki`]: certificates made at test time (a CA, servers, clients).
//! - [`config`]: router configs naming the kit's etcd clusters as shards.
//! - [`router`]: routers in-process, built from [`lockrouter::Application`].
//! - [`router_process`]: the `lockrouter` binary as a child process.
//! - [`api`]: a small JSON client for the router's HTTP API.
//! - [`procs`]: other programs whose stdout is JSON lines (examples,
//!   `lockrouter exec`).
//! - [`bins`]: where cargo put the binaries; examples built on demand.
//! - [`child`]: what every child shares: its log, dying with its parent.
//! - [`loopback`]: free ports and a blocking HTTP/1.0 client for probes,
//!   scrapes and admin calls.
//! - [`metrics`]: reading Prometheus text.
//! - [`procfs`]: a process's memory, CPU time and thread states.
//! - [`netns`]: network namespaces and bridges whose links tests cut (real
//!   packet loss between etcd members and routers).
//! - [`proxy`]: a loopback TCP proxy that can go silent (a member behind
//!   a dead link).
//! - [`history`]: recorded lock operations and the safety checker.
//! - [`openapi`]: `docs/openapi.yaml` as a checker of real answers.
//! - [`error`]: why a process could not be started.

pub mod api;
pub mod bins;
pub mod child;
pub mod config;
pub mod error;
pub mod etcd;
pub mod history;
pub mod loopback;
pub mod metrics;
pub mod netns;
pub mod openapi;
pub mod pki;
pub mod procfs;
pub mod procs;
pub mod proxy;
pub mod router;
pub mod router_process;

pub use error::Error;

/// Sleeps `ms` milliseconds.
pub async fn sleep_ms(ms: u64) {
    tokio::time::sleep(std::time::Duration::from_millis(ms)).await
}
