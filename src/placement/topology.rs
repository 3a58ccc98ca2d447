//! The router's view of its shards: the ring that places names, the shards
//! of that ring, and, while a migration is open, the previous ring and its
//! shards (some of them draining). A `Router` is immutable but for what its
//! monitor (`monitor.rs`) learns from etcd; a config reload builds a new one
//! (`reload.rs`), reusing live shard connections through the [`ShardPool`].
//!
//! Ring safety: a router grants only after it has seen *every* shard of its
//! ring record that ring (see `confirmed`). Rings recorded on shards only
//! move forward (fenced migrations), so once seen the fact stays true; and
//! two replicas started with different shard sets can never both grant.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{LockDelay, Settings, ShardSettings};
use crate::placement::ring::Ring;
use crate::shard::access::{Access, AccessError};
use crate::shard::conn::{ClientError, EtcdConn};
use crate::shard::keys::Recorded;
use crate::shard::{classify, Grantable, IdentityProblem, KeepaliveSettings, RingState, Shard};

/// Live shard connections, shared by successive routers of one process so
/// a reload keeps sessions, keepalive streams and connections. Holds weak
/// references: a shard no router uses is disconnected.
pub struct ShardPool {
    settings: Mutex<PoolSettings>,
    /// By shard name: what it was connected with (endpoints, and the
    /// contents of its TLS and password files), and the shard.
    shards: Mutex<HashMap<String, Pooled>>,
    /// By shard name: the settings this replica's own config last gave
    /// it, to reach a shard only a record on the shards names (a previous
    /// ring's) with this replica's TLS and user for it.
    configured: Mutex<HashMap<String, ShardSettings>>,
    cancel: CancellationToken,
}

type Pooled = (Access, Weak<Shard>);

/// The pool's settings and the shard settings its config gave, as a
/// reload found them.
pub struct PoolState {
    settings: PoolSettings,
    configured: HashMap<String, ShardSettings>,
}

#[derive(Clone, PartialEq)]
struct PoolSettings {
    prefix: String,
    timeout: Duration,
    connect_timeout: Duration,
    /// How keepalives go out (`etcd.keepalive_burst_ms`,
    /// `etcd.keepalive_streams`).
    keepalive: KeepaliveSettings,
    /// `etcd.barrier_spacing_ms`.
    barrier_spacing: Duration,
    /// `etcd.hand_on_idle_sessions`.
    hand_on_idle_sessions: bool,
}

impl ShardPool {
    pub fn new(settings: &Settings, cancel: CancellationToken) -> Arc<Self> {
        Arc::new(Self {
            settings: Mutex::new(PoolSettings::of(settings)),
            shards: Mutex::new(HashMap::new()),
            configured: Mutex::new(HashMap::new()),
            cancel,
        })
    }

    /// Applies connection settings; shards connected before keep theirs
    /// until they are next reconnected.
    pub fn configure(&self, settings: &Settings) {
        self.set(PoolSettings::of(settings));
    }

    fn set(&self, new: PoolSettings) {
        let mut current = self.settings.lock().expect("pool lock");
        if *current != new {
            *current = new;
            // Different deadlines, prefix or bursts: connect afresh from now on.
            self.shards.lock().expect("pool lock").clear();
        }
    }

    /// What a reload may change here, to [`restore`](Self::restore) if
    /// the reload fails: a refused reload changes nothing.
    pub fn state(&self) -> PoolState {
        PoolState {
            settings: self.settings.lock().expect("pool lock").clone(),
            configured: self.configured.lock().expect("pool lock").clone(),
        }
    }

    /// Puts back what [`state`](Self::state) saw; shards connected since
    /// under other settings are connected afresh when next asked for.
    pub fn restore(&self, state: PoolState) {
        *self.configured.lock().expect("pool lock") = state.configured;
        self.set(state.settings);
    }

    /// The live shard this replica's config describes as `shard`,
    /// connecting it if needed: its files are read now, and a shard
    /// connected with other endpoints or other file contents is connected
    /// anew.
    pub async fn get(&self, shard: &ShardSettings) -> Result<Arc<Shard>, ConnectError> {
        self.configured
            .lock()
            .expect("pool lock")
            .insert(shard.name.clone(), shard.clone());
        self.connect(shard).await
    }

    /// The live shard a record on the shards names (a previous ring's), at
    /// its recorded endpoints, with the TLS and user this replica's config
    /// last gave a shard of that name; never with files or a user the
    /// record names (a record is input: it may not make a router read a
    /// file or send a password).
    pub async fn get_recorded(&self, recorded: &ShardSettings) -> Result<Arc<Shard>, ConnectError> {
        let local = self
            .configured
            .lock()
            .expect("pool lock")
            .get(&recorded.name)
            .cloned();
        let shard = match local {
            Some(local) => ShardSettings {
                endpoints: recorded.endpoints.clone(),
                ..local
            },
            None => recorded.recordable(),
        };
        self.connect(&shard).await
    }

    async fn connect(&self, shard: &ShardSettings) -> Result<Arc<Shard>, ConnectError> {
        let name = &shard.name;
        let access = Access::load(shard)?;
        if let Some((known, weak)) = self.shards.lock().expect("pool lock").get(name) {
            if *known == access {
                if let Some(shard) = weak.upgrade() {
                    return Ok(shard);
                }
            }
        }
        let s = self.settings.lock().expect("pool lock").clone();
        let conn = EtcdConn::connect(name, &access, s.timeout, s.connect_timeout)
            .await
            .map_err(|source| ConnectError::Client {
                shard: name.to_string(),
                source,
            })?;
        let shard = Shard::start(
            conn,
            &s.prefix,
            s.keepalive,
            s.barrier_spacing,
            s.hand_on_idle_sessions,
            &self.cancel,
        );
        self.shards
            .lock()
            .expect("pool lock")
            .insert(name.to_string(), (access, Arc::downgrade(&shard)));
        Ok(shard)
    }
}

impl PoolSettings {
    fn of(s: &Settings) -> Self {
        Self {
            prefix: s.etcd.prefix.clone(),
            timeout: s.etcd.request_timeout(),
            connect_timeout: s.etcd.connect_timeout(),
            keepalive: KeepaliveSettings {
                burst: s.etcd.keepalive_burst(),
                streams: s.etcd.keepalive_streams,
            },
            barrier_spacing: s.etcd.barrier_spacing(),
            hand_on_idle_sessions: s.etcd.hand_on_idle_sessions,
        }
    }
}

/// Checks that the TLS and password files each of `shards` names can be
/// used, connecting nothing: a reload refuses a file it cannot use before
/// it changes anything. Only [`ConnectError::Access`] comes of it.
pub fn check_access(shards: &[ShardSettings]) -> Result<(), ConnectError> {
    for shard in shards {
        Access::load(shard)?;
    }
    Ok(())
}

/// A shard's etcd client could not be built; nothing is connected until
/// the first call, so an unreachable shard is not this error.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A TLS or password file the shard's settings name cannot be used.
    #[error(transparent)]
    Access(#[from] AccessError),
    /// A malformed endpoint that passed validation, or a TLS setup error.
    #[error("shard {shard:?}: {source}")]
    Client {
        shard: String,
        #[source]
        source: ClientError,
    },
}

/// An open migration as recorded on the shards.
/// A shard as `GET /admin/v1/ring` shows it: whether it answers, and the
/// ring and epoch it records.
#[derive(Debug, Clone)]
pub struct ShardFacts {
    pub name: String,
    /// `active` (of the ring) or `draining` (of a migration's previous
    /// ring only).
    pub role: &'static str,
    pub up: bool,
    pub recorded_ring: Option<String>,
    pub recorded_epoch: Option<u64>,
    /// Its weight in the ring (an active shard's).
    pub weight: Option<u32>,
}

impl ShardFacts {
    fn of(s: &Shard, role: &'static str, weight: Option<u32>) -> Self {
        let (recorded_ring, recorded_epoch) = match s.ring_state() {
            RingState::Ready(r) | RingState::Mismatch(r) => (Some(r.meta.ring), Some(r.meta.epoch)),
            _ => (None, None),
        };
        Self {
            name: s.name().to_string(),
            role,
            up: s.is_up(),
            recorded_ring,
            recorded_epoch,
            weight,
        }
    }
}

pub struct Migration {
    /// The recorded meta (new ring, new epoch, previous ring).
    pub recorded: Recorded,
    /// The previous ring, to find where a moved name was.
    pub ring: Ring,
    /// The previous ring's shards, by the previous ring's shard index.
    pub shards: Vec<Arc<Shard>>,
    /// Moved names still held on each previous shard, at the last count.
    pub moved_held: Mutex<BTreeMap<String, i64>>,
}

impl Migration {
    pub fn previous_shard(&self, name: &str) -> &Arc<Shard> {
        &self.shards[self.ring.shard_index(name)]
    }
}

pub struct Router {
    pub ring: Ring,
    /// The ring's shards, by shard index.
    pub shards: Vec<Arc<Shard>>,
    /// The shard list this ring was built from (recorded as `previous` when
    /// a migration leaves it).
    pub shard_settings: Vec<ShardSettings>,
    pub vnodes: u32,
    pub pool: Arc<ShardPool>,
    /// What the monitor does with lost holders' records it finds.
    pub lock_delay: LockDelay,
    /// Set by the monitor while the shards record an open migration.
    migration: RwLock<Option<Arc<Migration>>>,
    /// Every shard of the ring has been seen recording it.
    confirmed: AtomicBool,
    monitor: Mutex<Option<crate::task::TaskGuard>>,
}

/// A shard's state as `/readyz` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardState {
    /// Answers and grants.
    Up,
    /// Answers and records an open migration (grants, with handoff checks,
    /// once this router has attached it).
    Migrating,
    /// Does not answer.
    Unreachable,
    /// Answers, but this router has not yet seen every shard of its ring
    /// record it, or the shard records a migration it has not attached yet.
    Unconfirmed,
    /// Records no ring (new, or lost its data: see the epoch bump).
    Uninitialised,
    /// Records another ring: this replica's shard set differs.
    RingMismatch,
    /// The cluster at this shard's endpoints is another shard: this
    /// replica's config is wrong.
    IdentityMismatch,
    /// This shard's data answers from another etcd cluster (restored from
    /// a snapshot, copied): refused until the epoch is bumped.
    ClusterChanged,
}

impl ShardState {
    /// Every state, in the order `/readyz` documents them.
    pub const ALL: [ShardState; 8] = [
        ShardState::Up,
        ShardState::Migrating,
        ShardState::Unreachable,
        ShardState::Unconfirmed,
        ShardState::Uninitialised,
        ShardState::RingMismatch,
        ShardState::IdentityMismatch,
        ShardState::ClusterChanged,
    ];

    /// Its name in `/readyz` and in the `state` label of
    /// `lockrouter_shard_state`.
    pub fn as_str(self) -> &'static str {
        match self {
            ShardState::Up => "up",
            ShardState::Migrating => "migrating",
            ShardState::Unreachable => "unreachable",
            ShardState::Unconfirmed => "unconfirmed",
            ShardState::Uninitialised => "uninitialised",
            ShardState::RingMismatch => "ring_mismatch",
            ShardState::IdentityMismatch => "identity_mismatch",
            ShardState::ClusterChanged => "cluster_changed",
        }
    }
}

/// Why a shard may not grant now.
#[derive(Debug, Clone)]
pub enum NotServing {
    Down,
    Ring(String),
}

impl Router {
    /// Builds a router over `settings`' shards and starts its monitor.
    /// A router over `settings`' shards, not yet watched (see
    /// [`placement::serve`](crate::placement::serve)).
    pub(super) async fn new(
        settings: &Settings,
        pool: Arc<ShardPool>,
    ) -> Result<Arc<Self>, ConnectError> {
        let mut shards = Vec::new();
        for s in &settings.shards {
            shards.push(pool.get(s).await?);
        }
        let router = Arc::new(Self {
            ring: Ring::new(&settings.shards, settings.ring.vnodes),
            shards,
            shard_settings: settings.shards.clone(),
            vnodes: settings.ring.vnodes,
            pool,
            lock_delay: settings.locks.lock_delay,
            migration: RwLock::new(None),
            confirmed: AtomicBool::new(false),
            monitor: Mutex::new(None),
        });
        Ok(router)
    }

    /// A router over `settings`' ring with no shard connected: the lock
    /// layer's unit tests give their decisions in-memory shards directly.
    #[cfg(test)]
    pub(crate) fn unconnected(settings: &Settings) -> Arc<Self> {
        Arc::new(Self {
            ring: Ring::new(&settings.shards, settings.ring.vnodes),
            shards: Vec::new(),
            shard_settings: settings.shards.clone(),
            vnodes: settings.ring.vnodes,
            pool: ShardPool::new(settings, CancellationToken::new()),
            lock_delay: settings.locks.lock_delay,
            migration: RwLock::new(None),
            confirmed: AtomicBool::new(false),
            monitor: Mutex::new(None),
        })
    }

    /// Hands the router its monitor, which stops when the router retires.
    pub(super) fn watched_by(&self, monitor: crate::task::TaskGuard) {
        *self.monitor.lock().expect("monitor lock") = Some(monitor);
    }

    /// Takes over what `old`, serving the same ring, has learned: that every
    /// shard records the ring, and the open migration. Without the latter a
    /// new router could grant a moved name without the handoff check.
    pub fn inherit(&self, old: &Router) {
        debug_assert_eq!(self.ring.fingerprint(), old.ring.fingerprint());
        self.set_migration(old.migration());
        if old.is_confirmed() {
            self.confirmed.store(true, Ordering::Relaxed);
        }
    }

    /// Stops the monitor (the router is being replaced).
    pub fn retire(&self) {
        self.monitor.lock().expect("monitor lock").take();
    }

    pub fn shard_for(&self, name: &str) -> &Arc<Shard> {
        &self.shards[self.ring.shard_index(name)]
    }

    /// A shard of this ring or of the open migration's previous ring.
    pub fn shard_named(&self, name: &str) -> Option<Arc<Shard>> {
        if let Some(s) = self.shards.iter().find(|s| s.name() == name) {
            return Some(s.clone());
        }
        let migration = self.migration();
        migration.and_then(|m| m.shards.iter().find(|s| s.name() == name).cloned())
    }

    pub fn migration(&self) -> Option<Arc<Migration>> {
        self.migration.read().expect("migration lock").clone()
    }

    pub fn set_migration(&self, m: Option<Arc<Migration>>) {
        *self.migration.write().expect("migration lock") = m;
    }

    pub fn confirm(&self) {
        if !self.confirmed.swap(true, Ordering::Relaxed) {
            tracing::info!(ring = %self.ring.fingerprint(), "every shard records this router's ring; granting");
        }
    }

    pub fn is_confirmed(&self) -> bool {
        self.confirmed.load(Ordering::Relaxed)
    }

    /// What a grant on `shard` compares (its recorded ring, verified
    /// identity and the grant cut-off last seen), if it may grant.
    pub fn grantable(&self, shard: &Shard) -> Result<Grantable, NotServing> {
        if !shard.is_up() {
            return Err(NotServing::Down);
        }
        let ring = match self.ring_state_of(shard) {
            RingState::Ready(_) if !self.is_confirmed() => Err(NotServing::Ring(
                "not every shard has been seen recording this router's ring yet".into(),
            )),
            RingState::Ready(recorded) if !self.follows(&recorded) => Err(NotServing::Ring(
                "the shard records a migration this router has not attached yet; retry".into(),
            )),
            RingState::Ready(recorded) => Ok(recorded),
            RingState::Unknown => Err(NotServing::Ring("ring not read yet".into())),
            RingState::Absent => Err(NotServing::Ring(
                "no ring recorded on this shard (see the router log)".into(),
            )),
            RingState::Mismatch(found) => Err(NotServing::Ring(format!(
                "shard records ring {} epoch {}, this router has {}: reload this router's config",
                found.meta.ring,
                found.meta.epoch,
                self.ring.fingerprint()
            ))),
            RingState::Identity(why) => Err(NotServing::Ring(format!(
                "the cluster behind this shard's endpoints is not this shard: {}",
                why.detail()
            ))),
        }?;
        let identity = shard
            .verified_identity()
            .ok_or_else(|| NotServing::Ring("the shard's identity is not verified yet".into()))?;
        Ok(Grantable {
            ring,
            identity,
            cutoff: shard.cutoff(),
        })
    }

    /// What `shard` records, as this router sees it. The state is kept on
    /// the shard, and shards are shared by the routers of one replica
    /// across a reload: requests still in flight on the replaced router
    /// and the new router's monitor both update it, each classifying the
    /// record against its own ring. A record of another ring is never
    /// `Ready` here, whoever wrote the state: a router of ring X that took
    /// a shard recording ring Y as its own would place names by X and
    /// grant them under Y's record, which the txn's compare then accepts
    /// (docs/design.md, "Granting only under this router's own ring").
    pub fn ring_state_of(&self, shard: &Shard) -> RingState {
        match shard.ring_state() {
            RingState::Ready(r) | RingState::Mismatch(r) => {
                classify(Some(r), self.ring.fingerprint())
            }
            other => other,
        }
    }

    /// Whether this router knows the migration `recorded` is part of (if
    /// any): a moved name may be granted only with the handoff check, which
    /// needs the previous ring.
    pub fn follows(&self, recorded: &Recorded) -> bool {
        match &recorded.meta.previous {
            None => true,
            Some(prev) => self.migration().is_some_and(|m| {
                m.recorded.meta.epoch == recorded.meta.epoch
                    && m.recorded
                        .meta
                        .previous
                        .as_ref()
                        .is_some_and(|p| p.ring == prev.ring)
            }),
        }
    }

    /// Grants allowed on every shard of the ring right now.
    pub fn granting(&self) -> bool {
        self.is_confirmed()
            && self
                .shards
                .iter()
                .all(|s| matches!(self.ring_state_of(s), RingState::Ready(r) if self.follows(&r)))
    }

    /// An acquire txn found a ring other than the one it compared.
    pub fn ring_changed(&self, shard: &Shard, found: Option<Recorded>) {
        let state = classify(found, self.ring.fingerprint());
        log_ring_change(shard, &shard.ring_state(), &state, self.ring.fingerprint());
        shard.set_ring_state(state);
    }

    /// A txn found an identity other than the one verified on `shard`:
    /// nothing is granted, renewed or released there until the monitor
    /// verifies it again.
    pub fn identity_changed(&self, shard: &Shard) {
        shard.set_verified_identity(None);
        let state = RingState::Identity(IdentityProblem::OtherCluster(
            "its identity record changed since it was verified".into(),
        ));
        log_ring_change(shard, &shard.ring_state(), &state, self.ring.fingerprint());
        shard.set_ring_state(state);
    }

    /// What `GET /admin/v1/ring` shows of each shard: those of the ring
    /// (`active`, with their weight), then those of a migration's previous
    /// ring only (`draining`).
    pub fn shard_facts(&self) -> Vec<ShardFacts> {
        let mut facts: Vec<ShardFacts> = (self.shards.iter().zip(&self.shard_settings))
            .map(|(s, conf)| ShardFacts::of(s, "active", Some(conf.weight)))
            .collect();
        if let Some(m) = self.migration() {
            let draining = m
                .shards
                .iter()
                .filter(|s| !self.shards.iter().any(|c| c.name() == s.name()));
            facts.extend(draining.map(|s| ShardFacts::of(s, "draining", None)));
        }
        facts
    }

    /// The state of each shard of the ring, for `/readyz`.
    pub fn shard_states(&self) -> Vec<(String, ShardState)> {
        self.shards
            .iter()
            .map(|s| {
                let state = if !s.is_up() {
                    ShardState::Unreachable
                } else {
                    match self.ring_state_of(s) {
                        // A migration this router has not attached yet: it
                        // refuses grants there until its monitor does.
                        RingState::Ready(r) if !self.follows(&r) => ShardState::Unconfirmed,
                        RingState::Ready(r) if r.meta.previous.is_some() => ShardState::Migrating,
                        RingState::Ready(_) if self.is_confirmed() => ShardState::Up,
                        RingState::Ready(_) | RingState::Unknown => ShardState::Unconfirmed,
                        RingState::Absent => ShardState::Uninitialised,
                        RingState::Mismatch(_) => ShardState::RingMismatch,
                        RingState::Identity(IdentityProblem::OtherShard(_)) => {
                            ShardState::IdentityMismatch
                        }
                        RingState::Identity(IdentityProblem::OtherCluster(_)) => {
                            ShardState::ClusterChanged
                        }
                    }
                };
                (s.name().to_string(), state)
            })
            .collect()
    }

    /// Whether this replica can serve: its ring is confirmed on its shards,
    /// at least one shard answers, and no shard shows that this replica's
    /// own config is wrong (endpoints reaching another shard's cluster, or
    /// a shard set the shards do not record). A problem every replica
    /// shares (a shard unreachable, wiped, restored, or a migration not
    /// attached yet) does not make it unready: every replica would leave a
    /// load balancer at once, the healthy shards with them.
    pub fn ready(&self) -> bool {
        let states = self.shard_states();
        self.is_confirmed()
            && states.iter().any(|(_, s)| *s != ShardState::Unreachable)
            && !states
                .iter()
                .any(|(_, s)| matches!(s, ShardState::IdentityMismatch | ShardState::RingMismatch))
    }

    /// Names of shards that do not answer, and of shards that refuse grants.
    pub fn readiness(&self) -> (Vec<String>, Vec<String>) {
        let states = self.shard_states();
        let named = |want: fn(&ShardState) -> bool| {
            states
                .iter()
                .filter(|(_, s)| want(s))
                .map(|(n, _)| n.clone())
                .collect()
        };
        (
            named(|s| *s == ShardState::Unreachable),
            named(|s| {
                !matches!(
                    s,
                    ShardState::Up | ShardState::Migrating | ShardState::Unreachable
                )
            }),
        )
    }

    /// This ring's shards and, during a migration, the previous ring's.
    pub fn all_shards(&self) -> Vec<Arc<Shard>> {
        let mut all = self.shards.clone();
        if let Some(m) = self.migration() {
            for s in &m.shards {
                if !all.iter().any(|a| a.name() == s.name()) {
                    all.push(s.clone());
                }
            }
        }
        all
    }

    /// The epoch recorded on this ring's shards, if known.
    pub fn epoch(&self) -> Option<u64> {
        self.shards
            .iter()
            .find_map(|s| match self.ring_state_of(s) {
                RingState::Ready(r) => Some(r.meta.epoch),
                _ => None,
            })
    }
}

pub fn log_ring_change(shard: &Shard, old: &RingState, new: &RingState, ours: &str) {
    if old == new {
        return;
    }
    match new {
        RingState::Ready(r) => tracing::info!(
            shard = %shard.name(),
            epoch = r.meta.epoch,
            ring = %r.meta.ring,
            migrating = r.meta.previous.is_some(),
            "shard records this router's ring"
        ),
        RingState::Mismatch(r) => tracing::error!(
            shard = %shard.name(),
            recorded_ring = %r.meta.ring,
            recorded_epoch = r.meta.epoch,
            our_ring = %ours,
            "the shard records a different ring: this router's shard set differs from the one \
             the shards were rebalanced to (reload this router's config), or the shard set was \
             changed without a rebalance; refusing to grant on this shard"
        ),
        RingState::Absent => tracing::warn!(
            shard = %shard.name(),
            "the shard records no ring; it is initialised only when every shard is reachable \
             and none has ever been used, or by a migration or an epoch bump"
        ),
        RingState::Identity(why) => tracing::error!(
            shard = %shard.name(),
            problem = %why.detail(),
            "the etcd cluster at this shard's endpoints is not shard {:?}: check the endpoints \
             in this router's config; refusing to grant, renew or release on it",
            shard.name()
        ),
        RingState::Unknown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(connect_timeout_ms: u64) -> Settings {
        Settings::from_toml(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\
             [etcd]\nconnect_timeout_ms = {connect_timeout_ms}\n\
             [[shards]]\nname = \"a\"\nendpoints = [\"http://127.0.0.1:2\"]\n"
        ))
        .expect("a valid config")
    }

    #[test]
    fn a_restored_pool_has_the_settings_it_had_before_a_failed_reload() {
        let pool = ShardPool::new(&settings(1_000), CancellationToken::new());
        let before = pool.state();
        pool.configure(&settings(3_000));
        (pool.configured.lock().unwrap()).insert("b".into(), settings(3_000).shards[0].clone());
        let changed = pool.settings.lock().unwrap().connect_timeout;
        assert_eq!(changed, Duration::from_secs(3));
        pool.restore(before);
        let restored = pool.settings.lock().unwrap().connect_timeout;
        assert_eq!(restored, Duration::from_secs(1));
        assert!(pool.configured.lock().unwrap().is_empty());
    }
}
