//! One state per grant (lockId) in a client. The router answers an acquire
//! of a name the client already holds with the same grant, so two
//! [`Lock`](crate::Lock)s can stand for one lock; they must never disagree
//! (one released, the other still "held" and renewed). An acquire therefore
//! looks its grant up here and shares the state it finds.
//!
//! Entries are weak: a grant's state lives as long as a `Lock`, a handle or
//! a pending release needs it, and removes its own entry when it goes
//! (`Shared`'s drop calls [`Forget`], which the registry implements), so the
//! map holds no more than the grants in use.
//!
//! Deciding whether a grant is shared, superseded or being released happens
//! under one lock, so an acquire and a drop on different threads cannot
//! both think they own the grant. A grant released with a 204 is remembered
//! for a while from that answer on, whether its state is still alive or
//! gone: an acquire answered just before the release reached the router may
//! name it, and must ask again rather than hand out a lock the router has
//! already freed.
//!
//! It uses only the grant state (`state`) and the error types below it;
//! the client and its locks call it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::LostReason;
use crate::state::{Forget, Release, Shared};

/// A client's grants by lockId.
#[derive(Default)]
pub(crate) struct Registry {
    /// std `Mutex`: held only for a lookup or an update, never across an
    /// await, so the async mutex would only add cost.
    grants: Mutex<HashMap<String, Weak<Shared>>>,
    /// Grants released (204) whose state is gone, and when: an answer that
    /// names one raced the release.
    released: Mutex<HashMap<String, Instant>>,
}

/// How long a released grant is remembered: far longer than any acquire
/// answer can be in flight.
const REMEMBER_RELEASED: Duration = Duration::from_secs(300);
/// Most released grants remembered.
const MAX_RELEASED: usize = 10_000;

/// What an acquire's answer means for the client's state.
pub(crate) enum Claim {
    /// The client holds this grant already: the same state, its validity
    /// moved forward by the new answer.
    Held(Arc<Shared>),
    /// The client is releasing this grant; the answer raced the release.
    Releasing(Arc<Shared>),
    /// The client released this grant already; the answer raced the
    /// release. Ask again.
    Released,
    /// New state, now the grant's entry. Replaces the state of a grant the
    /// client had given up as lost (by its clock or the router's word)
    /// without releasing it: the router's answer says it still stands.
    New(Arc<Shared>),
}

impl Registry {
    /// The state for the grant `lock_id`, confirmed valid until
    /// `valid_until` by an acquire: the existing one if the client holds
    /// it, else one made by `make`.
    pub fn claim(
        &self,
        lock_id: &str,
        valid_until: Instant,
        make: impl FnOnce() -> Arc<Shared>,
    ) -> Claim {
        let mut grants = self.grants();
        // Released with a 204: its state may still be alive (the releasing
        // call has not returned) or on its way out; the answer is stale.
        if self.was_released(lock_id) {
            return Claim::Released;
        }
        let existing = grants.get(lock_id).and_then(Weak::upgrade);
        if let Some(shared) = &existing {
            if shared.current().release == Release::Pending {
                return Claim::Releasing(shared.clone());
            }
            shared.confirm(valid_until);
            if shared.lost_now().is_none() {
                return Claim::Held(shared.clone());
            }
        }
        let fresh = make();
        grants.insert(lock_id.to_string(), Arc::downgrade(&fresh));
        // The replaced state may be dropped with `existing`, and its drop
        // takes this lock: release it first.
        drop(grants);
        drop(existing);
        Claim::New(fresh)
    }

    /// Starts releasing `shared`: `None` if a newer state has taken its
    /// grant over (the grant is not this one's to release), else whether
    /// this call started the release (and so owns delivering it).
    pub fn begin_release(&self, shared: &Shared) -> Option<bool> {
        let grants = self.grants();
        let current = grants
            .get(&shared.lock_id())
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), shared));
        if !current {
            shared.mark_lost(LostReason::Released);
            return None;
        }
        Some(shared.begin_release())
    }

    /// Moves `shared` to the lockId an extend answered (see
    /// [`Shared::switch`]), and its entry with it, in one step under the
    /// registry's lock: a release or an acquire answer looking the grant up
    /// meanwhile finds it under one lockId or the other, never neither.
    /// False if the lock was lost meanwhile (it moves all the same, so
    /// that its release names the lockId the router holds it under).
    pub fn switch(
        &self,
        shared: &Arc<Shared>,
        lock_id: &str,
        ttl: Duration,
        margin: Duration,
        valid_until: Instant,
    ) -> bool {
        let mut grants = self.grants();
        let (old, live) = shared.switch(lock_id.to_string(), ttl, margin, valid_until);
        if old != lock_id {
            let current = grants
                .get(&old)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(shared)));
            if current {
                grants.remove(&old);
            }
            grants.insert(lock_id.to_string(), Arc::downgrade(shared));
        }
        live
    }

    /// The grants of `name` whose release is under way and unanswered: an
    /// acquire of `name` must wait for their answers first (see
    /// [`Client::acquire`](crate::Client::acquire)).
    pub fn releasing(&self, name: &str) -> Vec<Arc<Shared>> {
        let grants = self.grants();
        grants
            .values()
            .filter_map(Weak::upgrade)
            .filter(|s| s.name == name && s.current().release == Release::Pending)
            .collect()
    }

    fn was_released(&self, lock_id: &str) -> bool {
        let done = self.released();
        done.get(lock_id)
            .is_some_and(|at| at.elapsed() < REMEMBER_RELEASED)
    }

    fn released(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        self.released.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn grants(&self) -> MutexGuard<'_, HashMap<String, Weak<Shared>>> {
        // Nothing panics while holding it; if something did, the map is
        // still consistent (each update is one insert or remove).
        self.grants.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.grants().len()
    }
}

impl Forget for Registry {
    /// Remembers `lock_id` for a while: its release is confirmed.
    fn released(&self, lock_id: &str) {
        let mut done = self.released();
        let now = Instant::now();
        done.retain(|_, at| now.saturating_duration_since(*at) < REMEMBER_RELEASED);
        if done.len() >= MAX_RELEASED {
            done.clear();
        }
        done.insert(lock_id.to_string(), now);
    }

    /// Removes `lock_id`'s entry if its state is gone (called by that
    /// state's drop; a newer live entry stays).
    fn forget(&self, lock_id: &str) {
        let mut grants = self.grants();
        if grants.get(lock_id).is_some_and(|w| w.strong_count() == 0) {
            grants.remove(lock_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::state::tests::shared_in;

    const TTL: Duration = Duration::from_secs(30);

    fn claim(registry: &Arc<Registry>, key: u64, valid_for: Duration) -> Claim {
        let until = Instant::now() + valid_for;
        registry.claim(&format!("id-{key}"), until, || {
            shared_in(registry.clone(), key, TTL, valid_for)
        })
    }

    fn state(c: Claim) -> (&'static str, Arc<Shared>) {
        match c {
            Claim::Held(s) => ("held", s),
            Claim::Releasing(s) => ("releasing", s),
            Claim::New(s) => ("new", s),
            Claim::Released => panic!("released"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_acquire_shares_the_state_and_moves_validity_forward_only() {
        let registry = Arc::new(Registry::default());
        let (kind, first) = state(claim(&registry, 1, Duration::from_secs(10)));
        assert_eq!(kind, "new");
        tokio::time::advance(Duration::from_secs(2)).await;
        let (kind, second) = state(claim(&registry, 1, Duration::from_secs(20)));
        assert_eq!(kind, "held");
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(
            first.current().valid_until,
            Instant::now() + Duration::from_secs(20)
        );
        // An answer with less validity left does not move it back.
        let (_, third) = state(claim(&registry, 1, Duration::from_secs(1)));
        assert_eq!(
            third.current().valid_until,
            Instant::now() + Duration::from_secs(20)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_being_released_is_not_handed_out_again() {
        let registry = Arc::new(Registry::default());
        let (_, s) = state(claim(&registry, 1, Duration::from_secs(10)));
        assert_eq!(registry.begin_release(&s), Some(true), "first owns it");
        assert_eq!(registry.begin_release(&s), Some(false), "once");
        assert_eq!(s.current().lost, Some(LostReason::Released));
        let (kind, again) = state(claim(&registry, 1, Duration::from_secs(10)));
        assert_eq!(kind, "releasing");
        assert!(Arc::ptr_eq(&s, &again));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_grant_the_router_still_grants_gets_new_state_the_old_cannot_release() {
        let registry = Arc::new(Registry::default());
        let (_, old) = state(claim(&registry, 1, Duration::from_secs(1)));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(old.lost_now(), Some(LostReason::Unconfirmed));
        let (kind, new) = state(claim(&registry, 1, Duration::from_secs(10)));
        assert_eq!(kind, "new");
        assert!(new.lost_now().is_none(), "a lost lock is never revived");
        assert_eq!(old.lost_now(), Some(LostReason::Unconfirmed));
        // Dropping or releasing the old Lock must not free the new one's grant.
        assert_eq!(registry.begin_release(&old), None);
        assert_eq!(new.current().release, Release::NotStarted);
        drop(old);
        assert_eq!(registry.len(), 1, "the new entry stays");
        assert_eq!(registry.begin_release(&new), Some(true));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_names_a_grant_released_already_is_not_handed_out() {
        let registry = Arc::new(Registry::default());
        let (_, s) = state(claim(&registry, 1, Duration::from_secs(10)));
        assert_eq!(registry.begin_release(&s), Some(true));
        s.end_release(Release::Done);
        // The acquire's answer was sent before the release reached the
        // router: it names the grant the client just released, whose state
        // the releasing call still holds...
        assert!(matches!(
            claim(&registry, 1, Duration::from_secs(10)),
            Claim::Released
        ));
        // ...or has let go.
        drop(s);
        assert!(matches!(
            claim(&registry, 1, Duration::from_secs(10)),
            Claim::Released
        ));
        // Long after, the name is a fresh grant's again.
        tokio::time::advance(REMEMBER_RELEASED).await;
        let (kind, _) = state(claim(&registry, 1, Duration::from_secs(10)));
        assert_eq!(kind, "new");
    }

    #[tokio::test(start_paused = true)]
    async fn entries_go_with_their_last_holder() {
        let registry = Arc::new(Registry::default());
        let held: Vec<_> = (0..100)
            .map(|k| state(claim(&registry, k, Duration::from_secs(10))).1)
            .collect();
        assert_eq!(registry.len(), 100);
        drop(held);
        assert_eq!(registry.len(), 0);
    }
}
