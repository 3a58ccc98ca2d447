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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{ConfigError, Settings};
use crate::locks::{Active, Locks};
use crate::placement::migration::{self, BumpRequest, Refused};
use crate::placement::ring::Ring;
use crate::placement::topology::{self, ConnectError, ShardPool};

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
    /// A TLS or password file a shard's settings name cannot be used
    /// ([`ConnectError::Access`], from [`topology::check_access`]).
    #[error(transparent)]
    ShardAccess(ConnectError),
    /// A TLS file named in `[server]` cannot be used.
    #[error("{0}")]
    Tls(String),
    /// A lockId key of `[auth]` cannot be used.
    #[error("{0}")]
    Auth(String),
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
    /// The main listener's TLS config, replaced by each reload.
    tls: crate::tls::Shared,
    /// The principals, replaced by each reload.
    principals: crate::auth::Shared,
    /// The access log's switch (`server.access_log`), set by each reload.
    access_log: Arc<AtomicBool>,
}

impl From<Refused> for ReloadError {
    fn from(Refused(why): Refused) -> Self {
        ReloadError::Refused(why)
    }
}

impl Reloader {
    pub fn new(
        path: Option<PathBuf>,
        settings: Settings,
        locks: Arc<Locks>,
        pool: Arc<ShardPool>,
        tls: crate::tls::Shared,
        principals: crate::auth::Shared,
        access_log: Arc<AtomicBool>,
    ) -> Self {
        Self {
            path,
            locks,
            pool,
            current: tokio::sync::Mutex::new(settings),
            tls,
            principals,
            access_log,
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
        // Read first, swapped only once the rest applied: a bad file
        // changes nothing. Plain HTTP and TLS do not switch while serving.
        let tls = crate::tls::load(&new.server).map_err(ReloadError::Tls)?;
        let sealer = crate::auth::sealer(&new.auth).map_err(ReloadError::Auth)?;
        // admin.token reloads with the principals, at once.
        let principals = crate::auth::Principals::new(&new.auth, new.admin.token.as_deref())
            .map_err(ReloadError::Auth)?
            .with_admin_hosts(&new.admin.allowed_hosts);
        if tls.is_some() != self.tls.load().is_some() {
            return Err(ReloadError::NeedsRestart(
                "turning TLS on or off takes a restart; certificates and keys reload".into(),
            ));
        }
        topology::check_access(&new.shards).map_err(ReloadError::ShardAccess)?;
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
            let router = crate::placement::serve(new, self.pool.clone())
                .await
                .map_err(|e| ReloadError::Refused(e.to_string()))?;
            router.inherit(old_router);
            router
        } else if let Some(m) = old_router.migration() {
            let held = m.moved_held.lock().expect("moved lock").clone();
            return Err(ReloadError::Refused(format!(
                "a migration to ring {} (epoch {}) is still open, moved locks still held on their previous shards: {held:?}; \
                 reload again once it closes",
                m.recorded.meta.ring, m.recorded.meta.epoch
            )));
        } else if migration::already_moved(old_router, new, &ring).await? {
            // Another replica opened this migration: follow it.
            crate::placement::serve(new, self.pool.clone())
                .await
                .map_err(|e| ReloadError::Refused(e.to_string()))?
        } else {
            migration::open(old_router, new, &ring).await?;
            migration_opened = true;
            crate::placement::serve(new, self.pool.clone())
                .await
                .map_err(|e| ReloadError::Refused(e.to_string()))?
        };
        let replaced = self
            .locks
            .replace(Active::new(new, router, sealer, active.quotas.clone()));
        replaced.router.retire();
        self.tls.store(tls);
        self.principals.store(Arc::new(principals));
        let access_log = new.server.access_log;
        if self.access_log.swap(access_log, Ordering::Relaxed) != access_log {
            let now = if access_log { "on" } else { "off" };
            tracing::info!("access log turned {now}");
        }
        Ok(Reloaded {
            placement_changed,
            migration_opened,
            ring: ring.fingerprint().to_string(),
        })
    }

    /// Records the next epoch on every shard (`POST /admin/v1/bump-epoch`);
    /// serialised with reloads.
    pub async fn bump_epoch(&self, req: &BumpRequest) -> Result<u64, ReloadError> {
        let _serialised = self.current.lock().await;
        let router = self.locks.active().router.clone();
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
