//! Session leases: a client's locks on a shard share one etcd lease per
//! (clientId, TTL), so renewals cost O(clients) keepalives, not O(locks),
//! and an acquire needs no lease grant once the session exists.
//!
//! This cache is only an optimisation (etcd holds the truth): losing it, or
//! running several replicas, costs extra leases, never safety. A slot's async
//! mutex makes concurrent first acquires of one client share a single grant.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A session lease as the router knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLease {
    pub id: i64,
    pub ttl_secs: u32,
}

#[derive(Default)]
struct Slot {
    lease: tokio::sync::Mutex<Option<SessionLease>>,
    /// Last acquire that used the slot; idle slots are swept.
    last_used: Mutex<Option<Instant>>,
}

/// The per-shard session cache.
#[derive(Default)]
pub struct Sessions {
    /// std `Mutex`: held only to look up or insert a slot, never across an
    /// await, so the async mutex would only add cost.
    slots: Mutex<HashMap<(String, u32), Arc<Slot>>>,
}

impl Sessions {
    /// The client's session lease for `ttl_secs`, granting one with `grant`
    /// if there is none.
    pub async fn get_or_grant<F, Fut, E>(
        &self,
        client: &str,
        ttl_secs: u32,
        grant: F,
    ) -> Result<SessionLease, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<SessionLease, E>>,
    {
        let slot = {
            let mut slots = self.slots.lock().expect("sessions lock");
            slots
                .entry((client.to_string(), ttl_secs))
                .or_default()
                .clone()
        };
        *slot.last_used.lock().expect("slot lock") = Some(Instant::now());
        let mut lease = slot.lease.lock().await;
        if let Some(l) = *lease {
            return Ok(l);
        }
        let granted = grant().await?;
        *lease = Some(granted);
        Ok(granted)
    }

    /// Forgets `lease` (found expired) so the next acquire grants a new one.
    pub async fn invalidate(&self, client: &str, ttl_secs: u32, lease: i64) {
        let slot = {
            let slots = self.slots.lock().expect("sessions lock");
            slots.get(&(client.to_string(), ttl_secs)).cloned()
        };
        if let Some(slot) = slot {
            let mut current = slot.lease.lock().await;
            if current.map(|l| l.id) == Some(lease) {
                *current = None;
            }
        }
    }

    /// Drops slots unused for two TTLs plus `grace`; returns how many remain.
    pub fn sweep(&self, grace: Duration) -> usize {
        let mut slots = self.slots.lock().expect("sessions lock");
        slots.retain(|(_, ttl), slot| {
            let last = *slot.last_used.lock().expect("slot lock");
            let idle_limit = Duration::from_secs(2 * u64::from(*ttl)) + grace;
            last.is_some_and(|t| t.elapsed() < idle_limit) || slot.lease.try_lock().is_err()
        });
        slots.len()
    }

    pub fn len(&self) -> usize {
        self.slots.lock().expect("sessions lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
