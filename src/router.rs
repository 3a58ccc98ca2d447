//! The router's view of its shards: the ring that places names, the shards
//! themselves, and the monitor that keeps each shard's health and recorded
//! ring current.
//!
//! Ring safety at start-up: a shard with no ring recorded is initialised
//! (epoch 1) only when *every* shard answers and none records a ring at all,
//! that is, a fresh deployment. A shard that lost its data while others kept
//! theirs, or a shard set changed by editing the config, is refused (503)
//! with a log line saying why, never silently re-initialised: either could
//! grant a name twice or let tokens go backwards.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::etcd::EtcdConn;
use crate::keys::RingMeta;
use crate::metrics as m;
use crate::ring::Ring;
use crate::shard::{RingState, Shard};

pub struct Router {
    pub ring: Ring,
    pub shards: Vec<Arc<Shard>>,
    by_name: HashMap<String, usize>,
    _monitor: crate::TaskGuard,
}

/// Why a shard may not serve a request now.
#[derive(Debug, Clone)]
pub enum NotServing {
    Down,
    Ring(String),
}

impl Router {
    pub async fn start(
        settings: &Settings,
        cancel: &CancellationToken,
    ) -> Result<Arc<Self>, String> {
        let mut shards = Vec::new();
        for s in &settings.shards {
            let conn = EtcdConn::connect(
                &s.name,
                &s.endpoints,
                settings.request_timeout(),
                Duration::from_millis(settings.etcd.connect_timeout_ms),
            )
            .await
            .map_err(|e| format!("shard {:?}: {e}", s.name))?;
            shards.push(Arc::new(Shard::new(conn, &settings.etcd.prefix, cancel)));
        }
        let ring = Ring::new(&settings.shards, settings.ring.vnodes);
        let by_name = shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        let monitor_cancel = cancel.child_token();
        let task = tokio::spawn(monitor(
            shards.clone(),
            ring.fingerprint().to_string(),
            Intervals {
                health: Duration::from_millis(settings.etcd.health_interval_ms),
                count: Duration::from_millis(settings.etcd.count_interval_ms),
            },
            monitor_cancel.clone(),
        ));
        Ok(Arc::new(Self {
            ring,
            shards,
            by_name,
            _monitor: crate::TaskGuard::new(task, monitor_cancel),
        }))
    }

    pub fn shard_for(&self, name: &str) -> &Arc<Shard> {
        &self.shards[self.ring.shard_index(name)]
    }

    pub fn shard_named(&self, name: &str) -> Option<&Arc<Shard>> {
        self.by_name.get(name).map(|&i| &self.shards[i])
    }

    /// The ring to compare in an acquire on `shard`, if it may grant now.
    pub fn granting_ring(&self, shard: &Shard) -> Result<RingMeta, NotServing> {
        if !shard.conn.is_up() {
            return Err(NotServing::Down);
        }
        match shard.ring_state() {
            RingState::Ready(meta) => Ok(meta),
            RingState::Unknown => Err(NotServing::Ring("ring not read yet".into())),
            RingState::Absent => Err(NotServing::Ring(
                "no ring recorded on this shard (see the router log)".into(),
            )),
            RingState::Mismatch(found) => Err(NotServing::Ring(format!(
                "shard records ring {} epoch {}, this router has {}",
                found.ring,
                found.epoch,
                self.ring.fingerprint()
            ))),
        }
    }

    /// An acquire txn found a ring other than the one it compared.
    pub fn ring_changed(&self, shard: &Shard, found: Option<RingMeta>) {
        let state = classify(found, self.ring.fingerprint());
        log_ring_change(shard, &shard.ring_state(), &state, self.ring.fingerprint());
        shard.set_ring_state(state);
    }

    /// Names of shards that do not answer, and of shards that refuse grants.
    pub fn readiness(&self) -> (Vec<String>, Vec<String>) {
        let down = self
            .shards
            .iter()
            .filter(|s| !s.conn.is_up())
            .map(|s| s.name.clone())
            .collect();
        let refusing = self
            .shards
            .iter()
            .filter(|s| s.conn.is_up() && !matches!(s.ring_state(), RingState::Ready(_)))
            .map(|s| s.name.clone())
            .collect();
        (down, refusing)
    }
}

fn classify(found: Option<RingMeta>, fingerprint: &str) -> RingState {
    match found {
        None => RingState::Absent,
        Some(meta) if meta.ring == fingerprint => RingState::Ready(meta),
        Some(meta) => RingState::Mismatch(meta),
    }
}

fn log_ring_change(shard: &Shard, old: &RingState, new: &RingState, ours: &str) {
    if old == new {
        return;
    }
    match new {
        RingState::Ready(meta) => {
            tracing::info!(shard = %shard.name, epoch = meta.epoch, ring = %meta.ring, "shard ring matches; granting")
        }
        RingState::Mismatch(meta) => tracing::error!(
            shard = %shard.name,
            recorded_ring = %meta.ring,
            recorded_epoch = meta.epoch,
            our_ring = %ours,
            "the shard records a different ring: the shard set changed without a rebalance; refusing to grant on this shard"
        ),
        RingState::Absent => tracing::warn!(
            shard = %shard.name,
            "the shard records no ring; it is initialised only when every shard is reachable and none records one"
        ),
        RingState::Unknown => {}
    }
}

struct Intervals {
    health: Duration,
    count: Duration,
}

/// Probes every shard each health interval: health, recorded ring, first-use
/// initialisation, session-cache sweeping; counts active locks each count
/// interval.
async fn monitor(
    shards: Vec<Arc<Shard>>,
    fingerprint: String,
    every: Intervals,
    cancel: CancellationToken,
) {
    let fresh = RingMeta {
        epoch: 1,
        ring: fingerprint.clone(),
    };
    let mut last_count: Option<std::time::Instant> = None;
    loop {
        join_all(shards.iter().map(|s| s.conn.check_members())).await;
        let probes = join_all(shards.iter().map(|s| s.read_ring())).await;
        let mut states = Vec::with_capacity(shards.len());
        for (shard, probe) in shards.iter().zip(probes) {
            match probe {
                Ok(found) => {
                    shard.conn.set_up(true);
                    states.push(Some(classify(found, &fingerprint)));
                }
                Err(_) => states.push(None),
            }
        }
        let fresh_deployment = states.iter().all(|s| matches!(s, Some(RingState::Absent)));
        for (shard, state) in shards.iter().zip(states) {
            let Some(mut state) = state else { continue };
            if fresh_deployment {
                if let Ok(found) = shard.init_ring(&fresh).await {
                    state = classify(found, &fingerprint);
                }
            }
            log_ring_change(shard, &shard.ring_state(), &state, &fingerprint);
            if let RingState::Ready(meta) | RingState::Mismatch(meta) = &state {
                m::ring_state(
                    &shard.name,
                    meta.epoch,
                    matches!(state, RingState::Ready(_)),
                );
            }
            shard.set_ring_state(state);
        }
        for shard in &shards {
            m::session_leases(&shard.name, shard.sessions.sweep(Duration::from_secs(60)));
        }
        if last_count.is_none_or(|t| t.elapsed() >= every.count) {
            last_count = Some(std::time::Instant::now());
            let up = shards.iter().filter(|s| s.conn.is_up());
            let counts = join_all(up.map(|s| async move { (s, s.count_locks().await) })).await;
            for (shard, count) in counts {
                if let Ok(n) = count {
                    m::active_locks(&shard.name, n);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every.health) => {}
            _ = cancel.cancelled() => return,
        }
    }
}
