//! Placement: which shard owns a lock name, and how that changes.
//!
//! - [`ring`]: consistent hashing of names onto shards, with a fingerprint
//!   of everything that decides placement.
//! - [`topology`]: a router's shards, their states, and whether it may
//!   grant on each (the ring it serves, and any open migration).
//! - [`migration`]: the protocol that changes the shard set (open, follow,
//!   close) and the epoch bump.
//! - [`monitor`]: the task that reads what every shard records and acts on
//!   it (initialise, verify identities, follow and close migrations).

pub mod migration;
pub mod monitor;
pub mod ring;
pub mod topology;

use std::sync::Arc;

use crate::config::Settings;
use topology::{Router, ShardPool};

/// A router over `settings`' shards, with its monitor running: it grants
/// once the monitor has seen every shard record its ring (section 8 of the
/// design doc).
pub async fn serve(
    settings: &Settings,
    pool: Arc<ShardPool>,
) -> Result<Arc<Router>, topology::ConnectError> {
    let router = Router::new(settings, pool).await?;
    router.watched_by(monitor::start(&router, settings));
    Ok(router)
}
