//! Session leases: a client's locks on a shard share one etcd lease per
//! (clientId, TTL), so renewals cost O(clients) keepalives, not O(locks),
//! and an acquire needs no lease grant once the session exists.
//!
//! This cache is only an optimisation (etcd holds the truth): losing it, or
//! running several replicas, costs extra leases, never safety. A slot's async
//! mutex makes concurrent first acquires of one client share a single grant.
//!
//! A principal's session leases carry its
//! [`LeaseTag`] in the high bits of
//! their etcd lease id (etcd lets the client choose the id), so that every
//! replica's lock-key cache, which sees every lock key's lease, can count
//! the locks and sessions of each principal with no extra etcd read
//! (per-principal quotas). Every lease the shard grants goes through
//! [`grant_lease`], which puts the tag there.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::conn::{EtcdConn, EtcdError};
use super::keepalive::Renewal;
use crate::token::lease_tag::LeaseTag;

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
    /// Last lock renewal seen per session lease: a client that only renews
    /// keeps its slot, so its next acquire reuses the lease (else it would
    /// get a second session, and pay a second keepalive, on the shard).
    renewed: Mutex<HashMap<i64, Instant>>,
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

    /// Notes that a lock on `lease` was renewed through this router.
    pub fn touch(&self, lease: i64) {
        self.renewed
            .lock()
            .expect("renewed lock")
            .insert(lease, Instant::now());
    }

    /// Drops slots neither acquired through nor renewed for two TTLs plus
    /// `grace`; returns how many remain.
    pub fn sweep(&self, grace: Duration) -> usize {
        let mut slots = self.slots.lock().expect("sessions lock");
        let mut renewed = self.renewed.lock().expect("renewed lock");
        slots.retain(|(_, ttl), slot| {
            let idle_limit = Duration::from_secs(2 * u64::from(*ttl)) + grace;
            let recent = |t: &Option<Instant>| t.is_some_and(|t| t.elapsed() < idle_limit);
            let Ok(lease) = slot.lease.try_lock() else {
                return true; // being granted right now
            };
            let last_renewal = lease.and_then(|l| renewed.get(&l.id).copied());
            recent(&slot.last_used.lock().expect("slot lock")) || recent(&last_renewal)
        });
        // Keep renewal times only for leases still cached.
        let live: std::collections::HashSet<i64> = slots
            .values()
            .filter_map(|slot| slot.lease.try_lock().ok().and_then(|l| l.map(|l| l.id)))
            .collect();
        renewed.retain(|lease, _| live.contains(lease));
        slots.len()
    }
}

/// Grants a lease of `ttl_secs` on `conn`'s shard, its id carrying `tag`
/// if given (above: an id already in use, a chance of one in 2^39 per
/// lease of the tag, fails the grant, and the acquire answers 500; a retry
/// gets another); answers its id and its
/// grant (when it was sent, the TTL etcd granted).
pub(super) async fn grant_lease(
    conn: &EtcdConn,
    ttl_secs: u32,
    tag: Option<LeaseTag>,
) -> Result<(i64, Renewal), EtcdError> {
    let sent_at = Instant::now();
    let mut lease = conn.client().lease_client();
    let options = tag.map(|t| etcd_client::LeaseGrantOptions::new().with_id(t.new_lease_id()));
    let resp = conn
        .call("LeaseGrant", lease.grant(ttl_secs.into(), options))
        .await?;
    let granted = Renewal {
        sent_at,
        ttl_secs: resp.ttl(),
    };
    Ok((resp.id(), granted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: i64) -> impl Future<Output = Result<SessionLease, ()>> {
        std::future::ready(Ok(SessionLease { id, ttl_secs: 0 }))
    }

    #[tokio::test]
    async fn sessions_only_renewed_are_kept_and_idle_ones_swept() {
        let sessions = Sessions::default();
        let renewed = sessions
            .get_or_grant("renews", 0, || lease(7))
            .await
            .unwrap();
        sessions.get_or_grant("idle", 0, || lease(8)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
        sessions.touch(renewed.id);
        assert_eq!(sessions.sweep(Duration::from_millis(40)), 1);
        // The kept slot is reused: no second grant.
        let again = sessions
            .get_or_grant("renews", 0, || {
                std::future::ready(Err::<SessionLease, ()>(()))
            })
            .await
            .unwrap();
        assert_eq!(again, renewed);
    }

    #[tokio::test]
    async fn each_ttl_of_a_client_has_a_session_of_its_own() {
        let sessions = Sessions::default();
        let short = sessions.get_or_grant("c", 10, || lease(1)).await.unwrap();
        let long = sessions.get_or_grant("c", 60, || lease(2)).await.unwrap();
        let other = sessions.get_or_grant("d", 10, || lease(3)).await.unwrap();
        assert_eq!((short.id, long.id, other.id), (1, 2, 3));
        let refuse = || std::future::ready(Err::<SessionLease, ()>(()));
        assert_eq!(sessions.get_or_grant("c", 60, refuse).await, Ok(long));
        // Forgetting one TTL's lease leaves the other's.
        sessions.invalidate("c", 10, 1).await;
        assert_eq!(sessions.get_or_grant("c", 60, refuse).await, Ok(long));
        assert_eq!(sessions.get_or_grant("c", 10, refuse).await, Err(()));
        assert_eq!(
            sessions
                .get_or_grant("c", 10, || lease(4))
                .await
                .unwrap()
                .id,
            4
        );
        assert_eq!(sessions.sweep(Duration::from_secs(60)), 3);
    }
}
