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
//!
//! A slot also counts what the lease it holds is used for, so that the
//! lease of a session gone idle can be handed on to a new session
//! ([`recycle`](super::recycle)) only when no lock can ride on it: the
//! grant txns started on it and those not answered yet, and whether keys
//! may go on it any other way (a pin). The rules are here; why they are
//! enough is docs/design.md, "Idle sessions handed on".

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

/// How keys go on a session lease ([`Shard::session`]).
///
/// [`Shard::session`]: super::Shard::session
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionUse {
    /// Only by an acquire's grant txn, counted while it is in flight.
    Acquire,
    /// Any other way too (a waiter's entry, an extend's move): the lease
    /// stays this client's.
    Pinned,
}

#[derive(Default)]
struct Slot {
    lease: tokio::sync::Mutex<Option<SessionLease>>,
    /// Last acquire that used the slot; idle slots are swept.
    last_used: Mutex<Option<Instant>>,
    /// What the lease the slot owns has been used for. std `Mutex`: held
    /// for a few field updates, never across an await.
    uses: Mutex<Uses>,
}

/// The slot's ownership of its lease and what it was used for.
#[derive(Default)]
struct Uses {
    /// The lease owned, until it is found gone or handed on.
    lease: Option<i64>,
    /// Its tag, for the spares it may join.
    tag: Option<LeaseTag>,
    /// Changes with every ownership: an old ownership's txns never count
    /// for a new one.
    generation: u64,
    /// Grant txns started on the ownership.
    started: u64,
    /// Of those, not answered yet.
    in_flight: u32,
    /// Keys may go on the lease other than by a counted grant txn (a
    /// waiter's entry, an extend's move, a txn left unanswered): never
    /// handed on.
    pinned: bool,
}

impl Slot {
    fn owns(&self, lease: i64) -> bool {
        self.uses().lease == Some(lease)
    }

    /// The slot now owns `lease`, a new ownership with nothing used yet.
    fn own(&self, lease: i64, tag: Option<LeaseTag>) {
        let mut uses = self.uses();
        let generation = uses.generation + 1;
        *uses = Uses {
            lease: Some(lease),
            tag,
            generation,
            ..Uses::default()
        };
    }

    fn uses(&self) -> std::sync::MutexGuard<'_, Uses> {
        self.uses.lock().expect("uses lock")
    }
}

/// A grant txn on a session's lease, counted from before it is sent:
/// [`Use::settled`] once etcd answered it (or it was never sent); dropped
/// otherwise (an error, a timeout, the request gone), it pins the lease,
/// as the txn may still commit.
pub struct Use {
    slot: Arc<Slot>,
    generation: u64,
    settled: bool,
}

impl Use {
    /// Nothing this use sent can still commit.
    pub fn settled(mut self) {
        self.settled = true;
    }
}

impl Drop for Use {
    fn drop(&mut self) {
        let mut uses = self.slot.uses();
        if uses.generation == self.generation {
            uses.in_flight -= 1;
            uses.pinned |= !self.settled;
        }
    }
}

/// An idle session whose lease might be handed on, as the scan found it;
/// [`Sessions::retire`] hands it on only if nothing changed since.
pub struct Idle {
    slot: Arc<Slot>,
    pub lease: SessionLease,
    pub tag: Option<LeaseTag>,
    generation: u64,
    started: u64,
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
    /// (its id carrying `tag`) if there is none, or if the one it had was
    /// handed on.
    pub async fn get_or_grant<F, Fut, E>(
        &self,
        client: &str,
        ttl_secs: u32,
        tag: Option<LeaseTag>,
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
            if slot.owns(l.id) {
                return Ok(l);
            }
        }
        *lease = None;
        let granted = grant().await?;
        slot.own(granted.id, tag);
        *lease = Some(granted);
        Ok(granted)
    }

    fn slot(&self, client: &str, ttl_secs: u32) -> Option<Arc<Slot>> {
        let slots = self.slots.lock().expect("sessions lock");
        slots.get(&(client.to_string(), ttl_secs)).cloned()
    }

    /// Counts a grant txn about to go on `lease`, `client`'s session:
    /// `None` if the session no longer owns it (handed on, or found gone),
    /// and then no txn may go on it.
    pub fn begin_use(&self, client: &str, ttl_secs: u32, lease: i64) -> Option<Use> {
        let slot = self.slot(client, ttl_secs)?;
        let generation = {
            let mut uses = slot.uses();
            if uses.lease != Some(lease) {
                return None;
            }
            uses.started += 1;
            uses.in_flight += 1;
            uses.generation
        };
        Some(Use {
            slot,
            generation,
            settled: false,
        })
    }

    /// Pins `lease`, `client`'s session, for good: keys may go on it other
    /// than by a counted grant txn. `false` if the session no longer owns
    /// it (then nothing may go on it: get the session again).
    pub fn pin(&self, client: &str, ttl_secs: u32, lease: i64) -> bool {
        let Some(slot) = self.slot(client, ttl_secs) else {
            return false;
        };
        let mut uses = slot.uses();
        uses.pinned |= uses.lease == Some(lease);
        uses.lease == Some(lease)
    }

    /// Sessions with nothing in flight and no pin, whose last acquire is
    /// at least `idle_for(ttl)` before `now`: the candidates for handing
    /// on, as they are now.
    pub fn idle(&self, now: Instant, idle_for: impl Fn(u32) -> Duration) -> Vec<Idle> {
        let slots = self.slots.lock().expect("sessions lock");
        let mut idle = Vec::new();
        for ((_, ttl_secs), slot) in slots.iter() {
            let last_used = *slot.last_used.lock().expect("slot lock");
            let Some(last_used) = last_used else { continue };
            if now.saturating_duration_since(last_used) < idle_for(*ttl_secs) {
                continue;
            }
            let uses = slot.uses();
            let Some(lease) = uses.lease.filter(|_| uses.in_flight == 0 && !uses.pinned) else {
                continue;
            };
            idle.push(Idle {
                slot: slot.clone(),
                lease: SessionLease {
                    id: lease,
                    ttl_secs: *ttl_secs,
                },
                tag: uses.tag,
                generation: uses.generation,
                started: uses.started,
            });
        }
        idle
    }

    /// Ends `idle`'s ownership of its lease, if it is the same ownership,
    /// no grant txn started on it since [`Sessions::idle`] found it, none
    /// is in flight and it is not pinned: the slot's next acquire gets
    /// another lease, and one of its client that got this lease before
    /// finds it not owned ([`Sessions::begin_use`]). `true`: the lease is
    /// the caller's to hand on.
    pub fn retire(&self, idle: &Idle) -> bool {
        let slot = &idle.slot;
        {
            let mut uses = slot.uses();
            let same = uses.lease == Some(idle.lease.id)
                && uses.generation == idle.generation
                && uses.started == idle.started
                && uses.in_flight == 0
                && !uses.pinned;
            if !same {
                return false;
            }
            uses.lease = None;
            uses.generation += 1;
        }
        // Tidy only: an acquire holding the slot finds it not owned.
        if let Ok(mut lease) = slot.lease.try_lock() {
            if lease.map(|l| l.id) == Some(idle.lease.id) {
                *lease = None;
            }
        }
        true
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
            let mut uses = slot.uses();
            if uses.lease == Some(lease) {
                uses.lease = None;
                uses.generation += 1;
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
            .get_or_grant("renews", 0, None, || lease(7))
            .await
            .unwrap();
        sessions
            .get_or_grant("idle", 0, None, || lease(8))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
        sessions.touch(renewed.id);
        assert_eq!(sessions.sweep(Duration::from_millis(40)), 1);
        // The kept slot is reused: no second grant.
        let again = sessions
            .get_or_grant("renews", 0, None, || {
                std::future::ready(Err::<SessionLease, ()>(()))
            })
            .await
            .unwrap();
        assert_eq!(again, renewed);
    }

    #[tokio::test]
    async fn each_ttl_of_a_client_has_a_session_of_its_own() {
        let sessions = Sessions::default();
        let short = sessions
            .get_or_grant("c", 10, None, || lease(1))
            .await
            .unwrap();
        let long = sessions
            .get_or_grant("c", 60, None, || lease(2))
            .await
            .unwrap();
        let other = sessions
            .get_or_grant("d", 10, None, || lease(3))
            .await
            .unwrap();
        assert_eq!((short.id, long.id, other.id), (1, 2, 3));
        let refuse = || std::future::ready(Err::<SessionLease, ()>(()));
        assert_eq!(sessions.get_or_grant("c", 60, None, refuse).await, Ok(long));
        // Forgetting one TTL's lease leaves the other's.
        sessions.invalidate("c", 10, 1).await;
        assert_eq!(sessions.get_or_grant("c", 60, None, refuse).await, Ok(long));
        assert_eq!(sessions.get_or_grant("c", 10, None, refuse).await, Err(()));
        assert_eq!(
            sessions
                .get_or_grant("c", 10, None, || lease(4))
                .await
                .unwrap()
                .id,
            4
        );
        assert_eq!(sessions.sweep(Duration::from_secs(60)), 3);
    }

    /// `client`'s session on `lease_id`, as a scan a minute later finds it.
    async fn idle_session(sessions: &Sessions, client: &str, lease_id: i64) -> Idle {
        sessions
            .get_or_grant(client, 30, None, || lease(lease_id))
            .await
            .unwrap();
        let later = Instant::now() + Duration::from_secs(60);
        let mut idle = sessions.idle(later, |_| Duration::from_secs(7));
        let at = idle
            .iter()
            .position(|i| i.lease.id == lease_id)
            .expect("idle");
        idle.swap_remove(at)
    }

    #[tokio::test]
    async fn a_retired_session_refuses_its_clients_next_txn_and_gets_a_new_lease() {
        let sessions = Sessions::default();
        let idle = idle_session(&sessions, "a", 7).await;
        // A candidate only once idle long enough.
        assert!(sessions
            .idle(Instant::now(), |_| Duration::from_secs(7))
            .is_empty());
        assert!(sessions.retire(&idle));
        assert!(!sessions.retire(&idle), "handed on twice");
        // An acquire that got lease 7 before the retirement: its txn may
        // not go, and its retry gets another lease.
        assert!(sessions.begin_use("a", 30, 7).is_none());
        assert!(!sessions.pin("a", 30, 7));
        let again = sessions.get_or_grant("a", 30, None, || lease(8)).await;
        assert_eq!(again.unwrap().id, 8);
        assert!(sessions.begin_use("a", 30, 8).is_some());
        // Handed back to the same client later, as a new ownership, it may
        // carry that client's locks again.
        sessions.invalidate("a", 30, 8).await;
        let back = sessions.get_or_grant("a", 30, None, || lease(7)).await;
        assert_eq!(back.unwrap().id, 7);
        assert!(sessions.begin_use("a", 30, 7).is_some());
    }

    #[tokio::test]
    async fn a_txn_in_flight_or_started_since_the_scan_keeps_the_lease() {
        let sessions = Sessions::default();
        let idle = idle_session(&sessions, "a", 7).await;
        let txn = sessions.begin_use("a", 30, 7).unwrap();
        assert!(!sessions.retire(&idle), "a grant txn in flight");
        txn.settled();
        // Answered, but started after the scan: its key may be newer than
        // the barrier the pass waited for.
        assert!(
            !sessions.retire(&idle),
            "a grant txn started since the scan"
        );
        // Scanned again with nothing in flight: handed on.
        let idle = idle_session(&sessions, "a", 7).await;
        assert!(sessions.retire(&idle));
    }

    #[tokio::test]
    async fn pins_and_unanswered_txns_keep_a_lease_for_good() {
        let sessions = Sessions::default();
        idle_session(&sessions, "waits", 1).await;
        assert!(sessions.pin("waits", 30, 1));
        let later = Instant::now() + Duration::from_secs(60);
        assert!(sessions.idle(later, |_| Duration::ZERO).is_empty());

        let idle = idle_session(&sessions, "times-out", 2).await;
        drop(sessions.begin_use("times-out", 30, 2).unwrap());
        assert!(!sessions.retire(&idle));
        assert!(sessions.idle(later, |_| Duration::ZERO).is_empty());
    }

    #[tokio::test]
    async fn an_old_ownerships_txn_does_not_count_for_a_new_one() {
        let sessions = Sessions::default();
        idle_session(&sessions, "a", 7).await;
        let old = sessions.begin_use("a", 30, 7).unwrap();
        // Found gone; the next acquire gets lease 8.
        sessions.invalidate("a", 30, 7).await;
        sessions
            .get_or_grant("a", 30, None, || lease(8))
            .await
            .unwrap();
        let new = sessions.begin_use("a", 30, 8).unwrap();
        // The old txn ends unanswered: it neither pins nor frees lease 8.
        drop(old);
        let later = Instant::now() + Duration::from_secs(60);
        assert!(
            sessions.idle(later, |_| Duration::ZERO).is_empty(),
            "8 in flight"
        );
        new.settled();
        let idle = sessions.idle(later, |_| Duration::ZERO);
        assert_eq!(idle.iter().map(|i| i.lease.id).collect::<Vec<_>>(), [8]);
        assert!(sessions.retire(&idle[0]));
    }
}
