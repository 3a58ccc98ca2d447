//! Config reload, from SIGHUP, a changed config file, or
//! `POST /admin/v1/reload`.
//!
//! Settings that do not decide placement (limits, timeouts, endpoints)
//! apply at once: a new router over the same ring replaces the old one,
//! reusing its shard connections. A change of placement (shards added,
//! removed, re-weighted) opens a migration (`docs/design.md`): the new ring
//! is recorded, with a higher epoch and the previous ring, on every shard,
//! old and new, before the new router may grant; routers still on the old
//! ring then fail their acquire txns' compare and refuse to grant.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{ConfigError, Settings};
use crate::fencing::MAX_EPOCH;
use crate::keys::Recorded;
use crate::locks::{Active, Locks};
use crate::ring::Ring;
use crate::router::{opening_meta, Router, ShardPool};
use crate::shard::RingState;

/// Why a reload was refused. Nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("this router was started without a config file")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The reload cannot happen now (an open migration, a shard down).
    #[error("{0}")]
    Refused(String),
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
    locks: Arc<Locks>,
    pool: Arc<ShardPool>,
    /// The settings in force; the async mutex also serialises reloads.
    current: tokio::sync::Mutex<Settings>,
}

impl Reloader {
    pub fn new(
        path: Option<PathBuf>,
        settings: Settings,
        locks: Arc<Locks>,
        pool: Arc<ShardPool>,
    ) -> Self {
        Self {
            path,
            locks,
            pool,
            current: tokio::sync::Mutex::new(settings),
        }
    }

    /// Re-reads the config file and applies it; logs the outcome.
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        let result = self.reload_file().await;
        match &result {
            Ok(r) => tracing::info!(
                placement_changed = r.placement_changed,
                migration_opened = r.migration_opened,
                ring = %r.ring,
                "config reloaded"
            ),
            Err(e) => tracing::warn!(error = %e, "config reload refused; nothing changed"),
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
        if old.server.listen != new.server.listen
            || old.server.metrics_listen != new.server.metrics_listen
        {
            tracing::warn!("listen addresses change only when the router restarts");
        }
        let active = self.locks.active();
        let old_router = &active.router;
        let ring = Ring::new(&new.shards, new.ring.vnodes);
        self.pool.configure(new);
        let placement_changed = ring.fingerprint() != old_router.ring.fingerprint();
        let mut migration_opened = false;
        let router = if !placement_changed {
            let router = Router::start(new, self.pool.clone())
                .await
                .map_err(ReloadError::Refused)?;
            router.inherit(old_router);
            router
        } else if let Some(m) = old_router.migration() {
            let held = m.moved_held.lock().expect("moved lock").clone();
            return Err(ReloadError::Refused(format!(
                "a migration to ring {} (epoch {}) is still open, moved locks still held on their previous shards: {held:?}; \
                 reload again once it closes",
                m.recorded.meta.ring, m.recorded.meta.epoch
            )));
        } else if self.already_moved(new, &ring).await? {
            // Another replica opened this migration: follow it.
            Router::start(new, self.pool.clone())
                .await
                .map_err(ReloadError::Refused)?
        } else {
            self.open_migration(old_router, new, &ring).await?;
            migration_opened = true;
            Router::start(new, self.pool.clone())
                .await
                .map_err(ReloadError::Refused)?
        };
        let replaced = self.locks.replace(Active {
            router,
            limits: new.limits.clone(),
            coalesce: Duration::from_millis(new.etcd.keepalive_coalesce_ms),
        });
        replaced.router.retire();
        Ok(Reloaded {
            placement_changed,
            migration_opened,
            ring: ring.fingerprint().to_string(),
        })
    }

    /// Records the next epoch, same ring, on every shard: for a shard
    /// restored from a snapshot or one that lost its data (its revisions
    /// went back; it may record no ring at all). Every grant from then on
    /// carries a token above every earlier one. Needs every shard reachable
    /// and no open migration; a partial bump is safe and may be repeated.
    pub async fn bump_epoch(&self) -> Result<u64, ReloadError> {
        let refuse = |msg: String| Err(ReloadError::Refused(msg));
        let _serialised = self.current.lock().await;
        let router = self.locks.active().router.clone();
        if router.migration().is_some() {
            return refuse("a migration is open; bump the epoch once it closes".into());
        }
        let fp = router.ring.fingerprint();
        let mut found = Vec::new();
        for shard in &router.shards {
            match shard.read_ring().await {
                Ok(None) => found.push(None),
                Ok(Some(r)) if r.meta.ring == fp && r.meta.previous.is_none() => {
                    found.push(Some(r))
                }
                Ok(Some(r)) => {
                    return refuse(format!(
                        "shard {} records ring {} (epoch {}), not this router's",
                        shard.name, r.meta.ring, r.meta.epoch
                    ))
                }
                Err(e) => {
                    return refuse(format!(
                        "bumping the epoch needs every shard reachable: {e}"
                    ))
                }
            }
        }
        let Some(top) = found.iter().flatten().map(|r| r.meta.epoch).max() else {
            return refuse(
                "no shard records a ring yet; a fresh deployment is initialised by itself".into(),
            );
        };
        if top >= MAX_EPOCH {
            return refuse(format!("the ring epoch is at its maximum ({MAX_EPOCH})"));
        }
        let next = Recorded::new(crate::keys::RingMeta {
            epoch: top + 1,
            ring: fp.to_string(),
            previous: None,
        });
        for (shard, was) in router.shards.iter().zip(&found) {
            let expected = was.as_ref().map(|r| r.bytes.as_slice());
            match shard.swap_ring(expected, &next).await {
                Ok(Some(r)) if r == next => shard.set_ring_state(RingState::Ready(r)),
                other => {
                    return refuse(format!(
                        "shard {} changed under the bump ({other:?}); the bump is partial, which is safe: repeat it",
                        shard.name
                    ))
                }
            }
        }
        tracing::info!(epoch = top + 1, ring = %fp, "ring epoch bumped on every shard");
        Ok(top + 1)
    }

    /// Whether some shard of the new ring already records it.
    async fn already_moved(&self, new: &Settings, ring: &Ring) -> Result<bool, ReloadError> {
        for s in &new.shards {
            let shard = self
                .pool
                .get(&s.name, &s.endpoints)
                .await
                .map_err(ReloadError::Refused)?;
            let recorded = shard
                .read_ring()
                .await
                .map_err(|e| ReloadError::Refused(e.to_string()))?;
            if recorded.is_some_and(|r| r.meta.ring == ring.fingerprint()) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Fences every shard, old and new: each records the new ring, a higher
    /// epoch and the previous ring. Old shards first, so that routers on the
    /// old ring stop granting before anything grants under the new one.
    async fn open_migration(
        &self,
        old: &Router,
        new: &Settings,
        ring: &Ring,
    ) -> Result<(), ReloadError> {
        let refuse = |msg: String| Err(ReloadError::Refused(msg));
        if !old.is_confirmed() {
            return refuse(
                "this router does not serve its ring yet; a migration starts from a serving ring"
                    .into(),
            );
        }
        let mut recorded: Option<Recorded> = None;
        for shard in &old.shards {
            match shard.read_ring().await {
                Ok(Some(r)) if r.meta.ring == old.ring.fingerprint() && r.meta.previous.is_none() => {
                    if recorded.as_ref().is_some_and(|first| first.meta.epoch != r.meta.epoch) {
                        return refuse(format!("shard {} records another epoch than its peers", shard.name));
                    }
                    recorded = Some(r);
                }
                Ok(other) => {
                    return refuse(format!(
                        "shard {} does not record this router's ring ({:?}); a migration needs every shard serving it",
                        shard.name,
                        other.map(|r| r.meta.ring)
                    ))
                }
                Err(e) => return refuse(format!("a migration needs every shard reachable: {e}")),
            }
        }
        let Some(recorded) = recorded else {
            return refuse("no shards".into());
        };
        if recorded.meta.epoch >= MAX_EPOCH {
            return refuse(format!("the ring epoch is at its maximum ({MAX_EPOCH})"));
        }
        let mut joining = Vec::new();
        for s in new
            .shards
            .iter()
            .filter(|s| !old.shards.iter().any(|o| o.name == s.name))
        {
            let shard = self
                .pool
                .get(&s.name, &s.endpoints)
                .await
                .map_err(ReloadError::Refused)?;
            match shard.read_ring().await {
                Ok(None) => joining.push(shard),
                Ok(Some(r)) => {
                    return refuse(format!(
                        "new shard {} already records ring {} (epoch {}): a joining shard must be empty",
                        s.name, r.meta.ring, r.meta.epoch
                    ))
                }
                Err(e) => return refuse(format!("a migration needs every shard reachable: {e}")),
            }
        }
        let opening = Recorded::new(opening_meta(&recorded.meta, old, ring));
        let mut failures = Vec::new();
        for shard in &old.shards {
            if let Err(e) = shard.swap_ring(Some(&recorded.bytes), &opening).await {
                failures.push(format!("{}: {e}", shard.name));
            }
        }
        for shard in &joining {
            if let Err(e) = shard.swap_ring(None, &opening).await {
                failures.push(format!("{}: {e}", shard.name));
            }
        }
        tracing::info!(from = %old.ring.fingerprint(), to = %ring.fingerprint(), epoch = opening.meta.epoch, "migration opened");
        if !failures.is_empty() {
            // Safe as it stands (unfenced shards refuse the new ring); the
            // new router's monitor finishes the fence when they answer.
            tracing::warn!(
                ?failures,
                "migration fence incomplete; it is finished when these shards answer"
            );
        }
        Ok(())
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
        let mut seen = self.file_digest();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    tracing::info!("SIGHUP: reloading the config");
                    let _ = self.reload().await;
                    seen = self.file_digest();
                }
                _ = tokio::time::sleep(poll) => {
                    let now = self.file_digest();
                    if now.is_some() && now != seen {
                        tracing::info!("config file changed: reloading");
                        seen = now;
                        let _ = self.reload().await;
                    }
                }
            }
        }
    }

    fn file_digest(&self) -> Option<[u8; 32]> {
        use sha2::{Digest, Sha256};
        let bytes = std::fs::read(self.path.as_ref()?).ok()?;
        Some(Sha256::digest(bytes).into())
    }
}
