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
use crate::locks::{Active, Locks};
use crate::placement::ring::Ring;
use crate::placement::topology::{opening_meta, Router, ShardPool};
use crate::shard::keys::{Identity, Recorded, Reservation, RingMeta};
use crate::shard::{IdentityGuard, Probe, RingGuard, RingState, Shard};
use crate::token::fencing::MAX_EPOCH;

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
            lock_delay: new.locks.lock_delay,
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
    /// carries a token above every earlier one: the next epoch is above
    /// every epoch any shard records or has reserved, and is reserved on
    /// every shard before any records it. Needs every shard reachable and
    /// no migration it cannot see; a partial bump is safe and may be
    /// repeated. A shard that records nothing at all (no identity either)
    /// is initialised only if `req` names it: it may have lost its data, or
    /// this router's endpoints for it may reach the wrong cluster.
    pub async fn bump_epoch(&self, req: &BumpRequest) -> Result<u64, ReloadError> {
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
        for name in &req.reinitialize {
            if !shards.iter().any(|s| &s.name == name) {
                return refuse(format!(
                    "reinitialize names {name:?}, which is not a shard of this router"
                ));
            }
        }
        let mut steps = Vec::new();
        for shard in &shards {
            let probe = shard.probe().await.map_err(|e| {
                ReloadError::Refused(format!(
                    "bumping the epoch needs every shard reachable: {e}"
                ))
            })?;
            match &probe.ring {
                // A migration this router has not attached: bumping would
                // drop its `previous` and close it without the closing scan.
                Some(r) if r.meta.ring == fp && !router.follows(r) => {
                    return refuse(format!(
                        "shard {} records a migration this router has not attached yet; retry in a moment",
                        shard.name
                    ))
                }
                Some(r) if r.meta.ring != fp && previous.as_ref().is_none_or(|p| p.ring != r.meta.ring) => {
                    return refuse(format!(
                        "shard {} records ring {} (epoch {}), neither this router's ring nor the one it migrates from",
                        shard.name, r.meta.ring, r.meta.epoch
                    ))
                }
                _ => {}
            }
            let identity = bump_identity(shard, &probe, req)?;
            steps.push(Step {
                shard: shard.clone(),
                probe,
                identity,
            });
        }
        let top = steps.iter().map(|s| s.probe.top_epoch()).max().unwrap_or(0);
        if top == 0 && req.min_epoch.is_none() {
            return refuse(
                "no shard records a ring yet; a fresh deployment is initialised by itself".into(),
            );
        }
        let next = top.max(req.min_epoch.unwrap_or(0).saturating_sub(1)) + 1;
        if next > MAX_EPOCH {
            return refuse(format!(
                "the ring epoch would pass its maximum ({MAX_EPOCH})"
            ));
        }
        let new = Recorded::new(RingMeta {
            epoch: next,
            ring: fp.to_string(),
            previous,
        });
        change_epoch(&steps, &new)
            .await
            .map_err(ReloadError::Refused)?;
        for step in &steps {
            step.shard
                .set_verified_identity(Some(step.identity.new_bytes()));
            step.shard.set_ring_state(RingState::Ready(new.clone()));
        }
        tracing::info!(epoch = next, ring = %fp, "ring epoch bumped on every shard");
        Ok(next)
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

    /// Opens the migration from `old`'s ring to `ring` (or opens it anew
    /// over an opening left incomplete, by this or another replica): every
    /// shard, old and joining, must end up recording the opening meta (new
    /// ring, an epoch above every epoch any shard records or has reserved,
    /// previous ring). The epoch is reserved on every shard first; then old
    /// shards are fenced, so routers on the old ring stop granting before
    /// anything grants under the new, and joining shards last, each with its
    /// identity.
    async fn open_migration(
        &self,
        old: &Router,
        new: &Settings,
        ring: &Ring,
    ) -> Result<(), ReloadError> {
        let (from, to) = (old.ring.fingerprint(), ring.fingerprint());
        if !old.is_confirmed() {
            return refuse(
                "this router does not serve its ring yet; a migration starts from a serving ring"
                    .into(),
            );
        }
        let is_opening = |r: &Recorded| {
            r.meta.ring == to && r.meta.previous.as_ref().is_some_and(|p| p.ring == from)
        };
        let mut shards: Vec<(Arc<Shard>, bool)> =
            old.shards.iter().map(|s| (s.clone(), false)).collect();
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
            shards.push((shard, true));
        }
        let mut base = None::<u64>;
        let mut steps = Vec::new();
        for (shard, joining) in &shards {
            let probe = shard.probe().await.map_err(|e| {
                ReloadError::Refused(format!("a migration needs every shard reachable: {e}"))
            })?;
            match (&probe.ring, joining) {
                (Some(r), _) if is_opening(r) => {}
                (Some(r), false) if r.meta.ring == from && r.meta.previous.is_none() => {
                    if base.is_some_and(|b| b != r.meta.epoch) {
                        return refuse(format!(
                            "shard {} records another epoch than its peers",
                            shard.name
                        ));
                    }
                    base = Some(r.meta.epoch);
                }
                (None, true) if probe.identity.is_none() && probe.reservation.is_none() => {}
                (other, _) => {
                    let what = other
                        .as_ref()
                        .map(|r| format!("ring {} epoch {}", r.meta.ring, r.meta.epoch));
                    let role = if *joining {
                        "joining shard (must be empty)"
                    } else {
                        "shard"
                    };
                    return refuse(format!(
                        "{role} {} records {what:?}, which a migration from {from} cannot start from",
                        shard.name
                    ));
                }
            }
            let identity = opening_identity(shard, &probe, *joining)?;
            steps.push(Step {
                shard: shard.clone(),
                probe,
                identity,
            });
        }
        let top = steps.iter().map(|s| s.probe.top_epoch()).max().unwrap_or(0);
        if top >= MAX_EPOCH {
            return refuse(format!("the ring epoch is at its maximum ({MAX_EPOCH})"));
        }
        let opening = Recorded::new(opening_meta(top + 1, old, ring));
        change_epoch(&steps, &opening).await.map_err(|failure| {
            // Safe as it stands: a fenced shard refuses the old ring, and
            // the new ring is not served until every shard records it.
            ReloadError::Refused(format!(
                "the migration to ring {to} is only partly open ({failure}); the reload is retried at the next poll, \
                 or send SIGHUP / POST /admin/v1/reload"
            ))
        })?;
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
        let mut seen = self.file_digest().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    tracing::info!("SIGHUP: reloading the config");
                    let now = self.file_digest().await;
                    if !matches!(self.reload().await, Err(ReloadError::Refused(_))) {
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
                        if !matches!(self.reload().await, Err(ReloadError::Refused(_))) {
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

/// What `POST /admin/v1/bump-epoch` may carry.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BumpRequest {
    /// Shards that record nothing (lost their data) to initialise.
    #[serde(default)]
    pub reinitialize: Vec<String>,
    /// The lowest epoch to record: for when every shard lost its data, so
    /// none remembers the epochs used (take it from the highest fencing
    /// token your resources saw: `token >> 47`, plus one).
    #[serde(default)]
    pub min_epoch: Option<u64>,
}

fn refuse<T>(msg: String) -> Result<T, ReloadError> {
    Err(ReloadError::Refused(msg))
}

/// A random nonce naming one epoch reservation.
pub fn nonce() -> String {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let seed = (std::process::id(), n, std::time::SystemTime::now());
    format!("{:016x}", RandomState::new().hash_one(seed))
}

/// One shard's part in an epoch change: what it recorded when read, and
/// how its identity is checked or written.
struct Step {
    shard: Arc<Shard>,
    probe: Probe,
    identity: IdentityGuard,
}

impl IdentityGuard {
    /// The identity bytes the shard records once the change went through.
    fn new_bytes(&self) -> Vec<u8> {
        match self {
            IdentityGuard::Verified(b)
            | IdentityGuard::Create(b)
            | IdentityGuard::Replace(_, b) => b.clone(),
        }
    }
}

/// Reserves `new`'s epoch on every shard of `steps` (a compare-and-swap on
/// what each recorded when read), then records `new` on each in order, each
/// write guarded by that reservation: a later reservation by any other
/// writer stops this one. Stops at the first failure, naming it.
async fn change_epoch(steps: &[Step], new: &Recorded) -> Result<(), String> {
    let reservation = Reservation {
        epoch: new.meta.epoch,
        by: nonce(),
    };
    for step in steps {
        let seen = step.probe.reservation.as_ref().map(|(_, b)| b.as_slice());
        match step.shard.reserve_epoch(seen, &reservation).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "shard {} changed since it was read (another bump or migration?); epoch {} is skipped, retry",
                    step.shard.name, new.meta.epoch
                ))
            }
            Err(e) => return Err(format!("{}: {e}", step.shard.name)),
        }
    }
    for step in steps {
        let guard = RingGuard {
            reservation: Some(reservation.to_bytes()),
            identity: match &step.identity {
                IdentityGuard::Verified(b) => IdentityGuard::Verified(b.clone()),
                IdentityGuard::Create(b) => IdentityGuard::Create(b.clone()),
                IdentityGuard::Replace(a, b) => IdentityGuard::Replace(a.clone(), b.clone()),
            },
        };
        let expected = step.probe.ring.as_ref().map(|r| r.bytes.as_slice());
        match step.shard.swap_ring(expected, new, &guard).await {
            Ok(Some(r)) if r == *new => {}
            Ok(other) => {
                return Err(format!(
                    "{} now records {:?}",
                    step.shard.name,
                    other.map(|r| r.meta)
                ))
            }
            Err(e) => return Err(format!("{}: {e}", step.shard.name)),
        }
    }
    Ok(())
}

/// How a bump treats a shard's identity: kept if it names this shard (the
/// cluster id is brought up to date: a restored shard answers from another
/// cluster), created only for a shard that records nothing and that the
/// request names.
fn bump_identity(
    shard: &Shard,
    probe: &Probe,
    req: &BumpRequest,
) -> Result<IdentityGuard, ReloadError> {
    let current = Identity::new(&shard.name, probe.cluster_id);
    match &probe.identity {
        Some(Ok((id, bytes))) if id.shard == shard.name => Ok(if *id == current {
            IdentityGuard::Verified(bytes.clone())
        } else {
            IdentityGuard::Replace(bytes.clone(), current.to_bytes())
        }),
        Some(Ok((id, _))) => refuse(format!(
            "the cluster at shard {}'s endpoints is shard {:?}: fix this router's config",
            shard.name, id.shard
        )),
        Some(Err(_)) => refuse(format!(
            "shard {} records an unreadable identity",
            shard.name
        )),
        None if probe.ring.is_some() => refuse(format!(
            "shard {} records no identity yet; retry in a moment",
            shard.name
        )),
        None if req.reinitialize.contains(&shard.name) => {
            Ok(IdentityGuard::Create(current.to_bytes()))
        }
        None => refuse(format!(
            "shard {} records nothing: if it lost its data, bump with {{\"reinitialize\": [{:?}]}} \
             after checking that this router's endpoints for it are right",
            shard.name, shard.name
        )),
    }
}

/// How a migration's opening treats a shard's identity: an old shard must
/// carry the identity this router verified; a joining shard gets one.
fn opening_identity(
    shard: &Shard,
    probe: &Probe,
    joining: bool,
) -> Result<IdentityGuard, ReloadError> {
    let current = Identity::new(&shard.name, probe.cluster_id);
    match &probe.identity {
        Some(Ok((id, bytes))) if *id == current => Ok(IdentityGuard::Verified(bytes.clone())),
        None if joining => Ok(IdentityGuard::Create(current.to_bytes())),
        _ => refuse(format!(
            "shard {}'s identity is not verified (see the router log); a migration needs every shard's",
            shard.name
        )),
    }
}
