//! lockrouter: a stateless HTTP lock router in front of several independent
//! etcd clusters. A lock is a lease with a monotonic fencing token.
//!
//! # Layout
//! - [`config`]: settings from TOML and `LOCKROUTER__SECTION__KEY` variables.
//! - [`ring`]: consistent hashing of lock names onto shards.
//! - [`keys`]: the data layout on each shard.
//! - [`fencing`], [`lock_id`]: fencing-token and lockId formats.
//! - [`etcd`]: one etcd connection with deadlines, error classes, metrics.
//! - [`shard`]: one etcd cluster and the txns run on it.
//! - [`session`], [`keepalive`], [`verify`]: session leases, coalesced
//!   keepalives over one stream, batched verification of lock keys.
//! - [`router`]: the shards, their health and recorded ring.
//! - [`locks`]: the lock operations (acquire, renew, release, inspect).
//! - [`http`]: the v1 HTTP API; [`app`]: building and running a router.
//! - [`exec`]: `lockrouter exec`, running a command while holding a lock
//!   (through the `lockrouter-client` crate).
//! - [`metrics`]: Prometheus metrics.
//! - [`plan`]: `lockrouter plan`, the capacity model for sizing shards.

pub mod app;
pub mod config;
pub mod etcd;
pub mod exec;
pub mod fencing;
pub mod http;
pub mod keepalive;
pub mod keys;
pub mod lock_id;
pub mod locks;
pub mod metrics;
pub mod monitor;
pub mod plan;
pub mod reload;
pub mod ring;
pub mod router;
pub mod session;
pub mod shard;
pub mod verify;
pub mod wait;

pub use app::Application;
pub use config::Settings;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Owns a background task: dropping the guard cancels and aborts it, so no
/// task outlives the part of the router that started it.
pub struct TaskGuard {
    task: JoinHandle<()>,
    cancel: CancellationToken,
}

impl TaskGuard {
    pub fn new(task: JoinHandle<()>, cancel: CancellationToken) -> Self {
        Self { task, cancel }
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.task.abort();
    }
}
