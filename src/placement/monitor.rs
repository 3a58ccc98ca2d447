//! A router's monitor: every health interval it probes each shard (and each
//! member of multi-member shards), reads the ring each shard records, and
//! acts on it:
//! - a fresh deployment (every shard reachable, none recording a ring) is
//!   initialised at epoch 1;
//! - an open migration recorded on the shards is followed: the previous
//!   ring and its shards are attached to the router (before it may grant),
//!   a fence left incomplete is finished, and once no moved name is still
//!   held on its previous shard the migration is closed;
//! - once every shard records this router's ring, the router may grant.
//!
//! Each probe also verifies the shard's identity (`P/shard`): the cluster at
//! the configured endpoints must say it is this shard, with the cluster id
//! that answers. A shard initialised before shards had an identity gets one
//! recorded (only while it records this router's ring).
//!
//! It also sweeps idle session slots, samples per-shard lock counts, and
//! sets the lock-delay of lost holders whose names nobody asked for since.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio_util::sync::CancellationToken;

use crate::config::{LockDelay, Settings};
use crate::metrics as m;
use crate::placement::ring::Ring;
use crate::placement::topology::{classify, log_ring_change, Migration, Router};
use crate::shard::keys::{HeldValue, Identity, Recorded, Reservation, RingMeta};
use crate::shard::{IdentityGuard, IdentityProblem, Probe, RingGuard, RingState, Shard};

struct Intervals {
    health: Duration,
    count: Duration,
}

/// Starts the monitor of `router`; it stops when the guard drops or the
/// router is gone.
pub fn start(router: &Arc<Router>, settings: &Settings) -> crate::TaskGuard {
    let cancel = CancellationToken::new();
    let every = Intervals {
        health: Duration::from_millis(settings.etcd.health_interval_ms),
        count: Duration::from_millis(settings.etcd.count_interval_ms),
    };
    let task = tokio::spawn(run(Arc::downgrade(router), every, cancel.clone()));
    crate::TaskGuard::new(task, cancel)
}

/// Lost holders nobody asked about are looked for every this many lock
/// counts: the sweep reads every held record's key, and only storage and a
/// migration's close (which converts moved names' records itself) wait
/// for it.
const SWEEP_EVERY_COUNTS: u32 = 6;

async fn run(router: Weak<Router>, every: Intervals, cancel: CancellationToken) {
    let mut last_count: Option<Instant> = None;
    let mut counts = 0u32;
    loop {
        let Some(r) = router.upgrade() else { return };
        let count_due = last_count.is_none_or(|t| t.elapsed() >= every.count);
        if count_due {
            last_count = Some(Instant::now());
            counts = counts.wrapping_add(1);
        }
        let sweep_due = count_due && counts % SWEEP_EVERY_COUNTS == 1;
        tick(&r, count_due, sweep_due).await;
        drop(r);
        tokio::select! {
            _ = tokio::time::sleep(every.health) => {}
            _ = cancel.cancelled() => return,
        }
    }
}

async fn tick(router: &Router, count_due: bool, sweep_due: bool) {
    let fp = router.ring.fingerprint().to_string();
    let shards = &router.shards;
    join_all(all_shards(router).iter().map(|s| s.conn.check_members())).await;
    join_all(all_shards(router).iter().map(|s| s.conn.check_version())).await;
    let probes = join_all(shards.iter().map(|s| s.probe())).await;
    let mut states = Vec::with_capacity(shards.len());
    let mut fresh = true;
    for (shard, probe) in shards.iter().zip(&probes) {
        match probe {
            Ok(p) => {
                shard.conn.set_up(true);
                fresh &= p.ring.is_none() && p.identity.is_none() && p.reservation.is_none();
                states.push(Some(verify(shard, p, &fp).await));
            }
            Err(_) => {
                fresh = false;
                states.push(None);
            }
        }
    }
    if fresh {
        initialise(router, &probes, &mut states).await;
    }
    // The newest recorded meta of this ring says whether a migration is open.
    let newest = states
        .iter()
        .filter_map(|s| match s {
            Some(RingState::Ready(r)) => Some(r.clone()),
            _ => None,
        })
        .max_by_key(|r| (r.meta.epoch, r.meta.previous.is_none()));
    let attached = match &newest {
        Some(open) if open.meta.previous.is_some() => follow_migration(router, open).await,
        Some(closed) => {
            router.set_migration(None);
            finish_close(router, closed, &mut states).await;
            true
        }
        None => true,
    };
    for (shard, state) in shards.iter().zip(states.iter()) {
        let Some(state) = state else { continue };
        log_ring_change(shard, &shard.ring_state(), state, &fp);
        match state {
            RingState::Ready(r) | RingState::Mismatch(r) => m::ring_state(
                &shard.name,
                r.meta.epoch,
                matches!(state, RingState::Ready(_)),
            ),
            // Not grantable: the ring is not ok, whatever was recorded.
            RingState::Absent | RingState::Identity(_) => m::ring_ok(&shard.name, false),
            RingState::Unknown => {}
        }
        shard.set_ring_state(state.clone());
    }
    // Confirm only after the migration (if any) is attached: a router that
    // grants must know where moved names were.
    if attached
        && states
            .iter()
            .all(|s| matches!(s, Some(RingState::Ready(_))))
    {
        router.confirm();
    }
    if let Some(migration) = router.migration() {
        if count_due
            && states
                .iter()
                .all(|s| matches!(s, Some(RingState::Ready(_))))
        {
            maybe_close(router, &migration).await;
        }
    }
    let migration = router.migration();
    m::migration_open(migration.is_some());
    if migration.is_none() {
        for shard in &router.shards {
            m::migration_moved_held(&shard.name, 0);
        }
    }
    for shard in all_shards(router) {
        m::session_leases(&shard.name, shard.sessions.sweep(Duration::from_secs(60)));
    }
    if count_due {
        count_locks(router).await;
    }
    if sweep_due {
        for shard in all_shards(router).iter().filter(|s| s.conn.is_up()) {
            sweep_lost(router, shard).await;
        }
    }
}

/// Attaches the open migration `open` to the router; false if it cannot.
async fn follow_migration(router: &Router, open: &Recorded) -> bool {
    let Some(prev) = open.meta.previous.as_ref() else {
        return false;
    };
    let current = router.migration();
    let migration = match current {
        Some(m)
            if m.recorded.meta.epoch == open.meta.epoch
                && m.recorded.meta.previous == open.meta.previous =>
        {
            m
        }
        _ => {
            let ring = Ring::new(&prev.shards, prev.vnodes);
            if ring.fingerprint() != prev.ring {
                tracing::error!(recorded = %prev.ring, rebuilt = %ring.fingerprint(), "cannot rebuild the previous ring of the open migration");
                return false;
            }
            let mut shards = Vec::new();
            for s in &prev.shards {
                match router.pool.get(&s.name, &s.endpoints).await {
                    Ok(shard) => shards.push(shard),
                    Err(e) => {
                        tracing::error!(shard = %s.name, error = %e, "cannot connect a shard of the previous ring");
                        return false;
                    }
                }
            }
            tracing::info!(from = %prev.ring, to = %open.meta.ring, epoch = open.meta.epoch, "following an open migration");
            let m = Arc::new(Migration {
                recorded: open.clone(),
                ring,
                shards,
                moved_held: Mutex::new(BTreeMap::new()),
            });
            router.set_migration(Some(m.clone()));
            m
        }
    };
    // Draining shards are probed here, which keeps their up flag current
    // and verifies their identity (the endpoints recorded for them are
    // input, and may reach the wrong cluster). Nothing is written: a fence
    // left incomplete is completed by the opener's retry or by an epoch
    // bump, never guessed at here (a shard that records nothing may have
    // lost its data).
    let fp = router.ring.fingerprint();
    for shard in migration
        .shards
        .iter()
        .filter(|s| !router.shards.iter().any(|c| c.name == s.name))
    {
        if let Ok(probe) = shard.probe().await {
            let state = verify(shard, &probe, fp).await;
            log_ring_change(shard, &shard.ring_state(), &state, fp);
            shard.set_ring_state(state);
        }
    }
    true
}

/// Checks that `probe` comes from the cluster that is `shard` and says
/// what the shard records; sets (or clears) the shard's verified identity.
async fn verify(shard: &Shard, probe: &Probe, fp: &str) -> RingState {
    let answering = format!("{:016x}", probe.cluster_id);
    let (state, verified) = match &probe.identity {
        Some(Ok((id, bytes))) if id.shard == shard.name && id.cluster_id == answering => {
            (classify(probe.ring.clone(), fp), Some(bytes.clone()))
        }
        Some(Ok((id, _))) if id.shard != shard.name => (
            RingState::Identity(IdentityProblem::OtherShard(format!(
                "the etcd cluster at these endpoints is shard {:?}",
                id.shard
            ))),
            None,
        ),
        Some(Ok((id, _))) => (
            RingState::Identity(IdentityProblem::OtherCluster(format!(
                "the shard was recorded in etcd cluster {} but cluster {answering} answers: \
                 restored from a snapshot or copied to another cluster? Its revisions may have \
                 gone back; bump the epoch (docs/operations.md)",
                id.cluster_id
            ))),
            None,
        ),
        Some(Err(bytes)) => (
            RingState::Identity(IdentityProblem::OtherShard(format!(
                "unreadable identity record {:?}",
                String::from_utf8_lossy(bytes)
            ))),
            None,
        ),
        None => return adopt(shard, probe, fp).await,
    };
    shard.set_verified_identity(verified);
    state
}

/// A shard that records no identity: never initialised (it records nothing
/// at all), or initialised before shards had one. The latter gets this
/// shard's identity recorded, but only while it records this router's very
/// ring: a cluster holding the deployment's ring is one of its shards.
async fn adopt(shard: &Shard, probe: &Probe, fp: &str) -> RingState {
    shard.set_verified_identity(None);
    let Some(ring) = probe.ring.as_ref().filter(|r| r.meta.ring == fp) else {
        return classify(probe.ring.clone(), fp);
    };
    let identity = Identity::new(&shard.name, probe.cluster_id);
    match shard.adopt_identity(&identity, &ring.bytes).await {
        Ok(true) => {
            tracing::info!(shard = %shard.name, cluster = %identity.cluster_id, "recorded the shard's identity");
            shard.set_verified_identity(Some(identity.to_bytes()));
            RingState::Ready(ring.clone())
        }
        _ => RingState::Unknown, // looked at again next round
    }
}

/// Initialises a fresh deployment: every shard reachable and none ever
/// used. Records the ring at epoch 1, each shard's identity and the epoch
/// reservation, in shard-name order, stopping at the first shard some other
/// ring got to first: replicas racing with different shard sets then cannot
/// split the shards between them (lock ordering), so one of them ends up
/// with all of its shards and serves.
async fn initialise(
    router: &Router,
    probes: &[Result<Probe, crate::shard::conn::EtcdError>],
    states: &mut [Option<RingState>],
) {
    let fp = router.ring.fingerprint();
    let shards = &router.shards;
    let fresh = Recorded::new(RingMeta {
        epoch: 1,
        ring: fp.to_string(),
        previous: None,
    });
    let reservation = Reservation {
        epoch: 1,
        by: crate::reload::nonce(),
    };
    let mut order: Vec<usize> = (0..shards.len()).collect();
    order.sort_by(|&a, &b| shards[a].name.cmp(&shards[b].name));
    for i in order {
        let Ok(probe) = &probes[i] else { break };
        let identity = Identity::new(&shards[i].name, probe.cluster_id);
        match shards[i].initialise(&fresh, &identity, &reservation).await {
            Ok(true) => {
                shards[i].set_verified_identity(Some(identity.to_bytes()));
                states[i] = Some(RingState::Ready(fresh.clone()));
            }
            // Another replica got here first: verified next round.
            Ok(false) => {
                states[i] = Some(RingState::Unknown);
                break;
            }
            Err(_) => break,
        }
    }
}

/// Counts moved names still held on their previous shards; closes the
/// migration when there are none and every previous shard is fenced.
async fn maybe_close(router: &Router, migration: &Migration) {
    let mut total = 0;
    let mut held = BTreeMap::new();
    for shard in &migration.shards {
        let fenced = matches!(shard.read_ring().await, Ok(Some(r)) if r.meta.ring == router.ring.fingerprint());
        match (fenced, moved_names_left(router, shard).await) {
            (true, Ok(n)) => {
                m::migration_moved_held(&shard.name, n);
                held.insert(shard.name.clone(), n);
                total += n;
            }
            _ => return, // unknown: keep the migration open
        }
    }
    *migration.moved_held.lock().expect("moved lock") = held;
    if total > 0 {
        return;
    }
    let closed = Recorded::new(RingMeta {
        previous: None,
        ..migration.recorded.meta.clone()
    });
    let mut everywhere = true;
    for shard in all_shards(router) {
        let Some(guard) = verified_guard(&shard) else {
            everywhere = false;
            continue;
        };
        match shard
            .swap_ring(Some(&migration.recorded.bytes), &closed, &guard)
            .await
        {
            Ok(Some(r)) if r == closed => {}
            _ => everywhere = false,
        }
    }
    if everywhere {
        tracing::info!(ring = %closed.meta.ring, epoch = closed.meta.epoch, "migration closed: no moved name is held on its previous shard");
        for shard in &migration.shards {
            m::migration_moved_held(&shard.name, 0);
        }
        // The shards' known records first: detaching the migration while they
        // still showed the open one would refuse grants until the next round.
        for shard in &router.shards {
            shard.set_ring_state(RingState::Ready(closed.clone()));
        }
        router.set_migration(None);
    }
}

/// Moved names still present on their previous shard `shard`: held, lost
/// without a lock-delay set yet, or waiting out one. Any of them keeps the
/// migration open (the new shard checks there before granting).
async fn moved_names_left(
    router: &Router,
    shard: &Shard,
) -> Result<i64, crate::shard::conn::EtcdError> {
    let here = shard.name.clone();
    let mut moved = |name: &str| router.ring.shard_name(name) != here;
    let k = &shard.keys;
    let locks = shard.hashes_where(k.locks_range(), &mut moved).await?;
    let held = shard.hashes_where(k.held_range(), &mut moved).await?;
    let delays = shard.hashes_where(k.delay_range(), &mut moved).await?;
    // A held record without its lock key is a lost holder: set its
    // lock-delay now rather than at the next sweep, so the close is not
    // held up by it longer than the delay itself.
    let lost: Vec<&Vec<u8>> = held.iter().filter(|h| !locks.contains(h)).collect();
    if !lost.is_empty() {
        sweep_lost(router, shard).await;
    }
    // A held lock has a lock key and a held record: count names, not keys.
    let names: std::collections::HashSet<Vec<u8>> =
        locks.into_iter().chain(held).chain(delays).collect();
    Ok(names.len() as i64)
}

/// A ring replacement guarded by the identity verified on `shard`.
fn verified_guard(shard: &Shard) -> Option<RingGuard> {
    Some(RingGuard {
        reservation: None,
        identity: IdentityGuard::Verified(shard.verified_identity()?),
    })
}

/// Sets the lock-delay of holders lost on `shard` whose names nobody asked
/// for since (with lock-delay off: forgets their records), so that records
/// do not pile up and a migration's moved names do not wait for them.
async fn sweep_lost(router: &Router, shard: &Shard) {
    let Some(identity) = shard.verified_identity() else {
        return;
    };
    let Ok(orphans) = shard.orphaned_held().await else {
        return;
    };
    for orphan in orphans {
        // The sweep read keys only: read the record itself (its TTL, and the
        // mod revision the conversion compares).
        let Ok(Some(held)) = shard.get(orphan.key()).await else {
            continue;
        };
        let k = shard.keys_of_held(&held);
        let ttl = serde_json::from_slice::<HeldValue>(held.value())
            .map(|h| h.ttl)
            .unwrap_or(0);
        let done = match router.lock_delay {
            LockDelay::Ttl => crate::locks::set_lock_delay(shard, &k, &held, ttl, &identity)
                .await
                .map(|_| ()),
            LockDelay::Off => shard.forget_lost(&k, &held).await.map(|_| ()),
        };
        if done.is_err() {
            return; // the shard is struggling; next round
        }
    }
}

/// A migration was closed on some shards (then it is over everywhere: the
/// closer saw no moved lock left); record the closed meta on the rest.
async fn finish_close(router: &Router, closed: &Recorded, states: &mut [Option<RingState>]) {
    for (shard, state) in router.shards.iter().zip(states.iter_mut()) {
        if let Some(RingState::Ready(r)) = state {
            if r.meta.epoch == closed.meta.epoch && r.meta.previous.is_some() {
                let Some(guard) = verified_guard(shard) else {
                    continue;
                };
                if let Ok(found) = shard.swap_ring(Some(&r.bytes), closed, &guard).await {
                    *state = Some(classify(found, &closed.meta.ring));
                }
            }
        }
    }
}

/// This ring's shards and, during a migration, the previous ring's.
fn all_shards(router: &Router) -> Vec<Arc<Shard>> {
    let mut all = router.shards.clone();
    if let Some(m) = router.migration() {
        for s in &m.shards {
            if !all.iter().any(|a| a.name == s.name) {
                all.push(s.clone());
            }
        }
    }
    all
}

async fn count_locks(router: &Router) {
    let shards = all_shards(router);
    let up = shards.iter().filter(|s| s.conn.is_up());
    let counts = join_all(up.map(|s| async move { (s, s.count_locks().await) })).await;
    for (shard, count) in counts {
        if let Ok(n) = count {
            m::active_locks(&shard.name, n);
        }
    }
}
