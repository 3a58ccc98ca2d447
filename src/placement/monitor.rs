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

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::metrics as m;
use crate::placement::migration;
use crate::placement::topology::{log_ring_change, Router};
use crate::shard::keys::{Identity, Recorded, Reservation, RingMeta};
use crate::shard::{Probe, RingState};

struct Intervals {
    health: Duration,
    count: Duration,
    sweep: Duration,
}

/// Starts the monitor of `router`; it stops when the guard drops or the
/// router is gone.
pub fn start(router: &Arc<Router>, settings: &Settings) -> crate::task::TaskGuard {
    let cancel = CancellationToken::new();
    let count = settings.etcd.count_interval();
    let every = Intervals {
        health: settings.etcd.health_interval(),
        count,
        sweep: count * SWEEP_EVERY_COUNTS,
    };
    let task = tokio::spawn(run(Arc::downgrade(router), every, cancel.clone()));
    crate::task::TaskGuard::new(task, cancel)
}

/// A pass of the sweep for lost holders nobody asked about starts at most
/// once per this many lock-count intervals. Each tick reads one page of
/// held records' keys per shard (`Shard::sweep_step`), so a pass over many
/// held locks takes longer than that, at a bounded cost; only storage and
/// a migration's close (which sweeps the whole shard itself) wait for it.
const SWEEP_EVERY_COUNTS: u32 = 6;

async fn run(router: Weak<Router>, every: Intervals, cancel: CancellationToken) {
    let mut last_count: Option<Instant> = None;
    loop {
        let Some(r) = router.upgrade() else { return };
        let count_due = last_count.is_none_or(|t| t.elapsed() >= every.count);
        if count_due {
            last_count = Some(Instant::now());
        }
        tick(&r, count_due, every.sweep).await;
        drop(r);
        tokio::select! {
            _ = tokio::time::sleep(every.health) => {}
            _ = cancel.cancelled() => return,
        }
    }
}

async fn tick(router: &Router, count_due: bool, sweep_every: Duration) {
    let fp = router.ring.fingerprint().to_string();
    let shards = &router.shards;
    join_all(router.all_shards().iter().map(|s| s.check_version())).await;
    let probes = join_all(shards.iter().map(|s| s.probe())).await;
    let mut states = Vec::with_capacity(shards.len());
    let mut fresh = true;
    for (shard, probe) in shards.iter().zip(&probes) {
        match probe {
            Ok(p) => {
                fresh &= p.ring.is_none() && p.identity.is_none() && p.reservation.is_none();
                states.push(Some(shard.verify(p, &fp).await));
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
        Some(open) if open.meta.previous.is_some() => migration::follow(router, open).await,
        Some(closed) => {
            router.set_migration(None);
            migration::finish_close(router, closed, &mut states).await;
            true
        }
        None => true,
    };
    for (shard, state) in shards.iter().zip(states.iter()) {
        let Some(state) = state else { continue };
        log_ring_change(shard, &shard.ring_state(), state, &fp);
        match state {
            RingState::Ready(r) | RingState::Mismatch(r) => m::ring_state(
                shard.name(),
                r.meta.epoch,
                matches!(state, RingState::Ready(_)),
            ),
            // Not grantable: the ring is not ok, whatever was recorded.
            RingState::Absent | RingState::Identity(_) => m::ring_ok(shard.name(), false),
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
            migration::maybe_close(router, &migration).await;
        }
    }
    let migration = router.migration();
    m::migration_open(migration.is_some());
    if migration.is_none() {
        for shard in &router.shards {
            m::migration_moved_held(shard.name(), 0);
        }
    }
    if count_due {
        // Idle sessions are kept for two TTLs plus a minute: sweeping them
        // with the counts is soon enough, and each sweep walks every
        // session of the shard (a profile with 10K clients put 6% of the
        // router's CPU in a sweep on every health tick).
        for shard in router.all_shards() {
            m::session_leases(shard.name(), shard.sweep_sessions(Duration::from_secs(60)));
        }
        count_locks(router).await;
    }
    let up = router.all_shards();
    let up = up.iter().filter(|s| s.is_up());
    join_all(up.map(|s| s.sweep_step(router.lock_delay, sweep_every))).await;
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
        by: Reservation::fresh(1).by,
    };
    let mut order: Vec<usize> = (0..shards.len()).collect();
    order.sort_by(|&a, &b| shards[a].name().cmp(shards[b].name()));
    for i in order {
        let Ok(probe) = &probes[i] else { break };
        let identity = Identity::new(shards[i].name(), probe.cluster_id);
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

/// The lock keys of each shard: the lock-key cache's count while it is
/// usable (it holds every lock key), else a count-only range read.
async fn count_locks(router: &Router) {
    let shards = router.all_shards();
    let mut unsure = Vec::new();
    for shard in shards.iter() {
        let cached = shard.cached_locks();
        m::cache_state(shard.name(), cached);
        match cached {
            Some(n) => m::active_locks(shard.name(), n as i64),
            None if shard.is_up() => unsure.push(shard),
            None => {}
        }
    }
    let counts = join_all(
        unsure
            .into_iter()
            .map(|s| async move { (s, s.count_locks().await) }),
    )
    .await;
    for (shard, count) in counts {
        if let Ok(n) = count {
            m::active_locks(shard.name(), n);
        }
    }
}
