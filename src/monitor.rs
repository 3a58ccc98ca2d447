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
//! It also sweeps idle session slots and samples per-shard lock counts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::keys::{Recorded, RingMeta};
use crate::metrics as m;
use crate::ring::Ring;
use crate::router::{classify, log_ring_change, Migration, Router};
use crate::shard::{RingState, Shard};

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

async fn run(router: Weak<Router>, every: Intervals, cancel: CancellationToken) {
    let mut last_count: Option<Instant> = None;
    loop {
        let Some(r) = router.upgrade() else { return };
        let count_due = last_count.is_none_or(|t| t.elapsed() >= every.count);
        if count_due {
            last_count = Some(Instant::now());
        }
        tick(&r, count_due).await;
        drop(r);
        tokio::select! {
            _ = tokio::time::sleep(every.health) => {}
            _ = cancel.cancelled() => return,
        }
    }
}

async fn tick(router: &Router, count_due: bool) {
    let fp = router.ring.fingerprint().to_string();
    let shards = &router.shards;
    join_all(all_shards(router).iter().map(|s| s.conn.check_members())).await;
    let probes = join_all(shards.iter().map(|s| s.read_ring())).await;
    let mut states = Vec::with_capacity(shards.len());
    for (shard, probe) in shards.iter().zip(probes) {
        match probe {
            Ok(found) => {
                shard.conn.set_up(true);
                states.push(Some(classify(found, &fp)));
            }
            Err(_) => states.push(None),
        }
    }
    if states.iter().all(|s| matches!(s, Some(RingState::Absent))) {
        let fresh = Recorded::new(RingMeta {
            epoch: 1,
            ring: fp.clone(),
            previous: None,
        });
        // In shard-name order, stopping at the first shard some other ring
        // got to first: replicas racing with different shard sets then
        // cannot split the shards between them (lock ordering), so one of
        // them ends up with all of its shards and serves.
        let mut order: Vec<usize> = (0..shards.len()).collect();
        order.sort_by(|&a, &b| shards[a].name.cmp(&shards[b].name));
        for i in order {
            match shards[i].swap_ring(None, &fresh).await {
                Ok(found) => {
                    let state = classify(found, &fp);
                    let lost = !matches!(state, RingState::Ready(_));
                    states[i] = Some(state);
                    if lost {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
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
        if let RingState::Ready(r) | RingState::Mismatch(r) = state {
            m::ring_state(
                &shard.name,
                r.meta.epoch,
                matches!(state, RingState::Ready(_)),
            );
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
    // Draining shards are probed here, which keeps their up flag current.
    // Nothing is written: a fence left incomplete is completed by the
    // opener's retry or by an epoch bump, never guessed at here (a shard
    // that records nothing may have lost its data).
    for shard in migration
        .shards
        .iter()
        .filter(|s| !router.shards.iter().any(|c| c.name == s.name))
    {
        let _ = shard.read_ring().await;
    }
    true
}

/// Counts moved names still held on their previous shards; closes the
/// migration when there are none and every previous shard is fenced.
async fn maybe_close(router: &Router, migration: &Migration) {
    let mut total = 0;
    let mut held = BTreeMap::new();
    for shard in &migration.shards {
        let fenced = matches!(shard.read_ring().await, Ok(Some(r)) if r.meta.ring == router.ring.fingerprint());
        let here = shard.name.clone();
        let counted = shard
            .count_locks_where(|name| router.ring.shard_name(name) != here)
            .await;
        match (fenced, counted) {
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
        match shard
            .swap_ring(Some(&migration.recorded.bytes), &closed)
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

/// A migration was closed on some shards (then it is over everywhere: the
/// closer saw no moved lock left); record the closed meta on the rest.
async fn finish_close(router: &Router, closed: &Recorded, states: &mut [Option<RingState>]) {
    for (shard, state) in router.shards.iter().zip(states.iter_mut()) {
        if let Some(RingState::Ready(r)) = state {
            if r.meta.epoch == closed.meta.epoch && r.meta.previous.is_some() {
                if let Ok(found) = shard.swap_ring(Some(&r.bytes), closed).await {
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
