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
use crate::keys::{Recorded, RingMeta};
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
    /// The reload cannot happen now (an open migration, a shard down);
    /// a later try may succeed.
    #[error("{0}")]
    Refused(String),
    /// The change needs a restart (it is never applied by a reload).
    #[error("{0}")]
    NeedsRestart(String),
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
        crate::metrics::config_reload(match &result {
            Ok(_) => "reloaded",
            Err(ReloadError::Refused(_)) => "refused",
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
        if old.server.listen != new.server.listen
            || old.server.metrics_listen != new.server.metrics_listen
        {
            tracing::warn!("listen addresses change only when the router restarts");
        }
        if old.etcd.prefix != new.etcd.prefix {
            return Err(ReloadError::NeedsRestart(
                "etcd.prefix changes only when the router restarts (and moves every lock: see docs/design.md)".into(),
            ));
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
        } else if self.already_moved(old_router, new, &ring).await? {
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
        let fp = router.ring.fingerprint();
        // During a migration the bump keeps it open (same previous ring) and
        // also completes its fence on shards that missed it.
        let migration = router.migration();
        let previous = migration
            .as_ref()
            .and_then(|m| m.recorded.meta.previous.clone());
        let mut shards = router.shards.clone();
        if let Some(m) = &migration {
            shards.extend(
                m.shards
                    .iter()
                    .filter(|s| !router.shards.iter().any(|c| c.name == s.name))
                    .cloned(),
            );
        }
        let mut found = Vec::new();
        for shard in &shards {
            match shard.read_ring().await {
                // A migration this router has not attached: bumping would
                // drop its `previous` and close it without the closing scan.
                Ok(Some(r)) if r.meta.ring == fp && !router.follows(&r) => {
                    return refuse(format!(
                        "shard {} records a migration this router has not attached yet; retry in a moment",
                        shard.name
                    ))
                }
                Ok(r) if r.as_ref().is_none_or(|r| {
                    r.meta.ring == fp || previous.as_ref().is_some_and(|p| p.ring == r.meta.ring)
                }) => found.push(r),
                Ok(Some(r)) => {
                    return refuse(format!(
                        "shard {} records ring {} (epoch {}), neither this router's ring nor the one it migrates from",
                        shard.name, r.meta.ring, r.meta.epoch
                    ))
                }
                Ok(None) => unreachable!("matched above"),
                Err(e) => return refuse(format!("bumping the epoch needs every shard reachable: {e}")),
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
        let next = Recorded::new(RingMeta {
            epoch: top + 1,
            ring: fp.to_string(),
            previous,
        });
        for (shard, was) in shards.iter().zip(&found) {
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

    /// Whether every shard of the new ring already records it (another
    /// replica opened this migration, maybe closed it too).
    async fn already_moved(
        &self,
        old: &Router,
        new: &Settings,
        ring: &Ring,
    ) -> Result<bool, ReloadError> {
        // A removed shard must be fenced too, or the opening is resumed; one
        // that no longer answers (retired after the migration) is skipped.
        for shard in old
            .shards
            .iter()
            .filter(|o| !new.shards.iter().any(|s| s.name == o.name))
        {
            if let Ok(recorded) = shard.read_ring().await {
                if recorded.is_none_or(|r| r.meta.ring != ring.fingerprint()) {
                    return Ok(false);
                }
            }
        }
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
            if recorded.is_none_or(|r| r.meta.ring != ring.fingerprint()) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Opens the migration from `old`'s ring to `ring`, or resumes an
    /// opening left incomplete (by this or another replica): every shard,
    /// old and joining, must end up recording the opening meta (new ring,
    /// next epoch, previous ring). Old shards are fenced first, so routers
    /// on the old ring stop granting before anything grants under the new.
    async fn open_migration(
        &self,
        old: &Router,
        new: &Settings,
        ring: &Ring,
    ) -> Result<(), ReloadError> {
        let refuse = |msg: String| Err(ReloadError::Refused(msg));
        let (from, to) = (old.ring.fingerprint(), ring.fingerprint());
        let is_opening = |r: &Recorded| {
            r.meta.ring == to && r.meta.previous.as_ref().is_some_and(|p| p.ring == from)
        };
        let mut shards = old.shards.clone();
        for s in new
            .shards
            .iter()
            .filter(|s| !old.shards.iter().any(|o| o.name == s.name))
        {
            shards.push(
                self.pool
                    .get(&s.name, &s.endpoints)
                    .await
                    .map_err(ReloadError::Refused)?,
            );
        }
        let (mut to_fence, mut base, mut opened) = (Vec::new(), None::<Recorded>, None::<Recorded>);
        for shard in &shards {
            let joining = !old.shards.iter().any(|o| o.name == shard.name);
            match shard.read_ring().await {
                Err(e) => return refuse(format!("a migration needs every shard reachable: {e}")),
                Ok(Some(r)) if is_opening(&r) => opened = Some(r),
                Ok(Some(r)) if !joining && r.meta.ring == from && r.meta.previous.is_none() => {
                    if base.as_ref().is_some_and(|b| b.meta.epoch != r.meta.epoch) {
                        return refuse(format!(
                            "shard {} records another epoch than its peers",
                            shard.name
                        ));
                    }
                    base = Some(r.clone());
                    to_fence.push((shard.clone(), Some(r)));
                }
                Ok(None) if joining => to_fence.push((shard.clone(), None)),
                Ok(other) => {
                    let what =
                        other.map(|r| format!("ring {} epoch {}", r.meta.ring, r.meta.epoch));
                    let role = if joining {
                        "joining shard (must be empty)"
                    } else {
                        "shard"
                    };
                    return refuse(format!("{role} {} records {what:?}, which a migration from {from} cannot start from", shard.name));
                }
            }
        }
        let opening = match (opened, base) {
            (Some(o), _) => o,
            (None, Some(b)) if !old.is_confirmed() => {
                let _ = b;
                return refuse("this router does not serve its ring yet; a migration starts from a serving ring".into());
            }
            (None, Some(b)) if b.meta.epoch >= MAX_EPOCH => {
                return refuse(format!("the ring epoch is at its maximum ({MAX_EPOCH})"));
            }
            (None, Some(b)) => Recorded::new(opening_meta(&b.meta, old, ring)),
            (None, None) => return refuse("no shard records this router's ring".into()),
        };
        to_fence.sort_by_key(|(_, was)| was.is_none()); // old shards first
        let mut failures = Vec::new();
        for (shard, was) in &to_fence {
            match shard
                .swap_ring(was.as_ref().map(|r| r.bytes.as_slice()), &opening)
                .await
            {
                Ok(Some(r)) if r.meta.ring == to && r.meta.epoch == opening.meta.epoch => {}
                Ok(other) => failures.push(format!(
                    "{} now records {:?}",
                    shard.name,
                    other.map(|r| r.meta)
                )),
                Err(e) => failures.push(format!("{}: {e}", shard.name)),
            }
        }
        if !failures.is_empty() {
            // Safe as it stands: a fenced shard refuses the old ring, and
            // the new ring is not served until every shard records it.
            return refuse(format!(
                "the migration to ring {to} is only partly open ({}); the reload is retried at the next poll, \
                 or send SIGHUP / POST /admin/v1/reload",
                failures.join("; ")
            ));
        }
        tracing::info!(from = %from, to = %to, epoch = opening.meta.epoch, "migration open on every shard");
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
                    let now = self.file_digest();
                    if !matches!(self.reload().await, Err(ReloadError::Refused(_))) {
                        seen = now;
                    }
                }
                _ = tokio::time::sleep(poll) => {
                    let now = self.file_digest();
                    if now.is_some() && now != seen {
                        tracing::info!("config file changed: reloading");
                        // Refused for now (a migration still open, a shard
                        // down): tried again at the next poll. An invalid
                        // file is not retried until it changes.
                        if !matches!(self.reload().await, Err(ReloadError::Refused(_))) {
                            seen = now;
                        }
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
