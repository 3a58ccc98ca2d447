//! Config reload, from SIGHUP, a changed config file, or
//! `POST /admin/v1/reload`.
//!
//! A reload builds the next generation from the file with the function
//! start uses ([`Generation::build`]) and puts it in force whole, or, if
//! anything fails, changes nothing. Settings that do not decide placement
//! (limits, deadlines, endpoints, certificates, principals, the admin
//! token, the access log) apply at once: a new router over the same ring
//! replaces the old one, reusing its shard connections. What is sized or
//! bound at start ([`generation::start_only_changes`]) stays until a
//! restart, and the reload's log names it; a change no reload may make
//! ([`generation::refused_change`]) refuses it.
//!
//! A change of placement (shards added, removed, re-weighted) opens a
//! migration (`docs/design.md`): the new ring is recorded, with a higher
//! epoch and the previous ring, on every shard, old and new, before the
//! new router may grant; routers still on the old ring then fail their
//! acquire txns' compare and refuse to grant.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{ConfigError, Settings};
use crate::generation::{self, BuildError, Generation, InForce, RestartNeeded};
use crate::placement::migration::{self, BumpRequest, Refused};
use crate::placement::ring::Ring;
use crate::placement::topology::{self, ConnectError, Router, ShardPool};

/// Why a reload was refused. Nothing changed. Each message names the
/// problem; the error it comes of is its source.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("this router was started without a config file")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The migration or the epoch bump cannot happen now (a shard down, a
    /// record moved on); a later try may succeed.
    #[error(transparent)]
    Refused(#[from] Refused),
    /// The router over the new config cannot be made now (a shard it
    /// names cannot be connected); a later try may succeed.
    #[error(transparent)]
    Unserved(ConnectError),
    /// A placement change while a migration is still open: it waits until
    /// the moved locks are released from their previous shards.
    #[error(
        "a migration to ring {ring} (epoch {epoch}) is still open, moved locks still held on \
         their previous shards: {held:?}; reload again once it closes"
    )]
    MigrationOpen {
        ring: String,
        epoch: u64,
        /// Moved names still held, by previous shard.
        held: BTreeMap<String, i64>,
    },
    /// The change needs a restart (it is never applied by a reload).
    #[error(transparent)]
    NeedsRestart(#[from] RestartNeeded),
    /// A TLS or password file a shard's settings name cannot be used
    /// ([`ConnectError::Access`], from [`topology::check_access`]).
    #[error(transparent)]
    ShardAccess(ConnectError),
    /// A TLS file of `[server]`, or a lockId key of `[auth]`, cannot be
    /// used.
    #[error(transparent)]
    Build(#[from] BuildError),
}

impl ReloadError {
    /// Whether the same file may be put in force later, unchanged (a
    /// migration closes, a shard comes back): such a reload is tried again.
    pub fn retry_later(&self) -> bool {
        matches!(
            self,
            Self::Refused(_) | Self::Unserved(_) | Self::MigrationOpen { .. }
        )
    }
}

/// What a reload did.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reloaded {
    pub placement_changed: bool,
    pub migration_opened: bool,
    pub ring: String,
}

pub struct Reloader {
    path: Option<PathBuf>,
    /// The generation in force, which each reload replaces.
    in_force: Arc<InForce>,
    pool: Arc<ShardPool>,
    /// The settings in force; the async mutex also serialises reloads.
    current: tokio::sync::Mutex<Settings>,
}

impl Reloader {
    /// A reloader of `path` (none: reloads are refused), over the
    /// generation `in_force` that `settings` built.
    pub(crate) fn new(
        path: Option<PathBuf>,
        settings: Settings,
        in_force: Arc<InForce>,
        pool: Arc<ShardPool>,
    ) -> Self {
        Self {
            path,
            in_force,
            pool,
            current: tokio::sync::Mutex::new(settings),
        }
    }

    /// Re-reads the config file and applies it; logs the outcome.
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        let result = self.reload_file().await;
        crate::metrics::config_reload(match &result {
            Ok(_) => "reloaded",
            Err(e) if e.retry_later() => "refused",
            Err(_) => "invalid",
        });
        match &result {
            Ok(r) => tracing::info!(
                placement_changed = r.placement_changed,
                migration_opened = r.migration_opened,
                ring = %r.ring,
                "config reloaded"
            ),
            Err(e) => tracing::warn!(error = %e, "config reload refused"),
        }
        result
    }

    async fn reload_file(&self) -> Result<Reloaded, ReloadError> {
        let path = self.path.as_ref().ok_or(ReloadError::NoFile)?;
        let new = Settings::load(path)?;
        let mut current = self.current.lock().await;
        let done = self.apply(&current, &new).await?;
        *current = new;
        Ok(done)
    }

    async fn apply(&self, old: &Settings, new: &Settings) -> Result<Reloaded, ReloadError> {
        let left = generation::start_only_changes(old, new);
        if !left.is_empty() {
            tracing::warn!(
                settings = ?left,
                "these settings change only when the router restarts"
            );
        }
        let current = self.in_force.current();
        let old_router = &current.locks.active().router;
        let ring = Ring::new(&new.shards, new.ring.vnodes);
        let placement_changed = ring.fingerprint() != old_router.ring.fingerprint();
        let mut migration_opened = false;
        // The files are read (and a bad one refuses the reload) before
        // the router is made: a migration is opened only for a config that
        // can be put in force.
        let router = async {
            if let Some(why) = generation::refused_change(old, new) {
                return Err(why.into());
            }
            topology::check_access(&new.shards).map_err(ReloadError::ShardAccess)?;
            self.pool.configure(new);
            self.next_router(old_router, new, &ring, &mut migration_opened)
                .await
        };
        let before = self.pool.state();
        let next = match Generation::build(new, Some(&current), router).await {
            Ok(next) => next,
            Err(e) => {
                self.pool.restore(before);
                return Err(e);
            }
        };
        let access_log = next.front.access_log;
        let replaced = self.in_force.replace(next);
        replaced.locks.active().router.retire();
        if replaced.front.access_log != access_log {
            let now = if access_log { "on" } else { "off" };
            tracing::info!("access log turned {now}");
        }
        Ok(Reloaded {
            placement_changed,
            migration_opened,
            ring: ring.fingerprint().to_string(),
        })
    }

    /// The router over `new`: over the same ring, it inherits what
    /// `old` learnt; over a new ring it follows the migration another
    /// replica opened, or opens it (`opened`).
    async fn next_router(
        &self,
        old: &Arc<Router>,
        new: &Settings,
        ring: &Ring,
        opened: &mut bool,
    ) -> Result<Arc<Router>, ReloadError> {
        let serve = || async {
            crate::placement::serve(new, self.pool.clone())
                .await
                .map_err(ReloadError::Unserved)
        };
        if ring.fingerprint() == old.ring.fingerprint() {
            let router = serve().await?;
            router.inherit(old);
            return Ok(router);
        }
        if let Some(m) = old.migration() {
            return Err(ReloadError::MigrationOpen {
                ring: m.recorded.meta.ring.clone(),
                epoch: m.recorded.meta.epoch,
                held: m.moved_held.lock().expect("moved lock").clone(),
            });
        }
        if migration::already_moved(old, new, ring).await? {
            // Another replica opened this migration: follow it.
            return serve().await;
        }
        migration::open(old, new, ring).await?;
        *opened = true;
        serve().await
    }

    /// Records the next epoch on every shard (`POST /admin/v1/bump-epoch`);
    /// serialised with reloads.
    pub async fn bump_epoch(&self, req: &BumpRequest) -> Result<u64, ReloadError> {
        let _serialised = self.current.lock().await;
        let router = self.in_force.current().locks.active().router.clone();
        Ok(migration::bump_epoch(&router, req).await?)
    }

    /// Reloads on SIGHUP and whenever the config file's content changes
    /// (polled, so symlink swaps such as Kubernetes ConfigMap updates and
    /// editors' atomic renames are seen; polling also debounces).
    pub async fn watch(self: Arc<Self>, poll: Duration, stop: CancellationToken) {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP");
                None
            }
        };
        let mut seen = self.file_digest().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    tracing::info!("SIGHUP: reloading the config");
                    let now = self.file_digest().await;
                    if !self.reload().await.as_ref().is_err_and(ReloadError::retry_later) {
                        seen = now;
                    }
                }
                _ = tokio::time::sleep(poll) => {
                    let now = self.file_digest().await;
                    if now.is_some() && now != seen {
                        tracing::info!("config file changed: reloading");
                        // Refused for now (a migration still open, a shard
                        // down): tried again at the next poll. An invalid
                        // file is not retried until it changes.
                        if !self.reload().await.as_ref().is_err_and(ReloadError::retry_later) {
                            seen = now;
                        }
                    }
                }
            }
        }
    }

    /// The config file's digest, read without blocking the runtime.
    async fn file_digest(&self) -> Option<[u8; 32]> {
        use sha2::{Digest, Sha256};
        let bytes = tokio::fs::read(self.path.as_ref()?).await.ok()?;
        Some(Sha256::digest(bytes).into())
    }
}
