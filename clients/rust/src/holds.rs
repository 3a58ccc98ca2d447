//! Who in this client holds each name. The router knows one holder per
//! client id, so it would hand two tasks of one [`Client`](crate::Client)
//! the same grant and both would "hold" the name. Users of other lock
//! libraries (redis-py, Redisson, kazoo) expect a lock to exclude every
//! other caller, their own threads included; so a client lets one hold of
//! a name at a time: another acquire of it waits its turn (first come,
//! first served) for as long as its wait allows, or gets nothing.
//!
//! A name's turn is taken before the acquire is sent and kept by the
//! grant's `Lock` until it is released or dropped, so no two acquires of
//! one name by one client are ever on the wire at once. A lost lock keeps
//! its turn until its `Lock` is released: the next holder then gets a new
//! grant with a larger token, never the lost one's (the resource can tell
//! the two apart).
//!
//! Re-entrance is asked for explicitly: a re-entrant acquire of a name this
//! client holds (and has not lost) joins the hold, counted; the grant is
//! released when the last of its holds lets go.
//!
//! It uses only the grant state (`state`); the keeper holds one per client.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::state::{Release, Shared};

/// A client's holds, by name.
#[derive(Default)]
pub(crate) struct Holds {
    /// std `Mutex`: held for a lookup or an update, never across an await.
    names: Mutex<HashMap<String, Entry>>,
}

struct Entry {
    /// One permit: the name's turn. Its waiters are served in arrival order.
    turn: Arc<Semaphore>,
    /// The grant holding the turn, and how many holds it has.
    held: Option<Held>,
}

struct Held {
    grant: Weak<Shared>,
    count: usize,
    /// Given back when the last hold lets go (see [`LetGo`]).
    permit: OwnedSemaphorePermit,
}

/// A name's turn, taken by an acquire that is on its way. Dropped without
/// [`Holds::hold`] (no grant, an error, a cancelled call), it passes the
/// turn on.
pub(crate) struct Turn {
    name: String,
    permit: Option<OwnedSemaphorePermit>,
    holds: Arc<Holds>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            drop(permit);
            self.holds.tidy(&self.name);
        }
    }
}

/// What one hold letting go of a grant leaves to do.
#[must_use = "the last hold's turn passes on when it is dropped"]
pub(crate) enum LetGo {
    /// Other holds keep the grant.
    Kept,
    /// That was the last hold: release the grant. The name's turn (if the
    /// grant held it here) passes on when this is dropped, so drop it only
    /// once the release has begun: the next in line then finds the release
    /// under way and waits for its answer, instead of asking the router
    /// while the grant still stands and being handed that same grant.
    Last(Option<Turn>),
}

impl Holds {
    /// Waits for `name`'s turn until `deadline` (`None`: as long as it
    /// takes); `None` if the deadline came first.
    pub async fn take(self: &Arc<Self>, name: &str, deadline: Option<Instant>) -> Option<Turn> {
        let turn = self
            .names()
            .entry(name.to_string())
            .or_insert_with(|| Entry {
                turn: Arc::new(Semaphore::new(1)),
                held: None,
            })
            .turn
            .clone();
        let wait = turn.acquire_owned();
        let permit = match deadline {
            None => wait.await.ok(),
            Some(d) => match tokio::time::timeout_at(d, wait).await {
                Ok(p) => p.ok(),
                // `try_acquire` too: a deadline already past still takes a
                // free turn.
                Err(_) => self.free_turn(name),
            },
        };
        let Some(permit) = permit else {
            self.tidy(name);
            return None;
        };
        Some(Turn {
            name: name.to_string(),
            permit: Some(permit),
            holds: self.clone(),
        })
    }

    fn free_turn(&self, name: &str) -> Option<OwnedSemaphorePermit> {
        let names = self.names();
        names.get(name)?.turn.clone().try_acquire_owned().ok()
    }

    /// Hands `turn` to `grant`: its first hold.
    pub fn hold(&self, mut turn: Turn, grant: &Arc<Shared>) {
        let Some(permit) = turn.permit.take() else {
            return;
        };
        let mut names = self.names();
        if let Some(entry) = names.get_mut(&turn.name) {
            entry.held = Some(Held {
                grant: Arc::downgrade(grant),
                count: 1,
                permit,
            });
        }
    }

    /// A re-entrant acquire: one more hold of `name`'s grant, if this client
    /// holds it, has not lost it and is not releasing it.
    pub fn join(&self, name: &str) -> Option<Arc<Shared>> {
        let mut names = self.names();
        let held = names.get_mut(name)?.held.as_mut()?;
        let grant = held.grant.upgrade()?;
        let usable = grant.lost_now().is_none() && grant.current().release == Release::NotStarted;
        if !usable {
            return None;
        }
        held.count += 1;
        Some(grant)
    }

    /// The fencing token of the grant holding `name` here, if it is not
    /// lost.
    pub fn holding(&self, name: &str) -> Option<u64> {
        let names = self.names();
        let grant = names.get(name)?.held.as_ref()?.grant.upgrade()?;
        drop(names);
        grant.lost_now().is_none().then_some(grant.fencing_token)
    }

    /// One hold of `grant` lets go. [`LetGo::Last`] if it was the last
    /// (the grant is to be released now), or if `grant` holds no turn here.
    pub fn let_go(self: &Arc<Self>, grant: &Shared) -> LetGo {
        let mut names = self.names();
        let Some(held) = names.get_mut(&grant.name).and_then(|e| e.held.as_mut()) else {
            return LetGo::Last(None);
        };
        if !std::ptr::eq(held.grant.as_ptr(), grant) {
            return LetGo::Last(None);
        }
        held.count -= 1;
        if held.count > 0 {
            return LetGo::Kept;
        }
        let held = names.get_mut(&grant.name).and_then(|e| e.held.take());
        LetGo::Last(held.map(|h| Turn {
            name: grant.name.clone(),
            permit: Some(h.permit),
            holds: self.clone(),
        }))
    }

    /// Drops `name`'s entry once nobody holds or waits for its turn.
    fn tidy(&self, name: &str) {
        let mut names = self.names();
        let idle = names
            .get(name)
            .is_some_and(|e| e.held.is_none() && Arc::strong_count(&e.turn) == 1);
        if idle {
            names.remove(name);
        }
    }

    fn names(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // Nothing panics while holding it; each update leaves it consistent.
        self.names.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.names().len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::state::tests::shared;

    fn soon(ms: u64) -> Option<Instant> {
        Some(Instant::now() + Duration::from_millis(ms))
    }

    #[tokio::test(start_paused = true)]
    async fn one_hold_at_a_time_and_the_next_in_line_gets_the_turn() {
        let holds = Arc::new(Holds::default());
        let grant = shared(1, Duration::from_secs(30), Duration::from_secs(30));
        let first = holds.take("lock-1", None).await.unwrap();
        holds.hold(first, &grant);
        assert!(holds.take("lock-1", soon(0)).await.is_none(), "held");
        let waiting = {
            let holds = holds.clone();
            tokio::spawn(async move { holds.take("lock-1", soon(1_000)).await.is_some() })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            matches!(holds.let_go(&grant), LetGo::Last(Some(_))),
            "the only hold"
        );
        assert!(waiting.await.unwrap(), "the waiter got the turn");
        assert_eq!(holds.len(), 0, "nothing left behind");
    }

    #[tokio::test(start_paused = true)]
    async fn re_entrant_holds_are_counted_and_a_lost_grant_cannot_be_joined() {
        let holds = Arc::new(Holds::default());
        let grant = shared(1, Duration::from_secs(30), Duration::from_secs(10));
        let turn = holds.take("lock-1", None).await.unwrap();
        holds.hold(turn, &grant);
        let joined = holds.join("lock-1").expect("held, not lost");
        assert!(Arc::ptr_eq(&joined, &grant));
        assert!(matches!(holds.let_go(&grant), LetGo::Kept), "one hold left");
        assert!(holds.take("lock-1", soon(0)).await.is_none());
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(holds.join("lock-1").is_none(), "lost: not joined");
        assert!(
            matches!(holds.let_go(&grant), LetGo::Last(Some(_))),
            "the last hold"
        );
        assert!(holds.take("lock-1", soon(0)).await.is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn the_last_holds_turn_passes_on_only_when_dropped() {
        let holds = Arc::new(Holds::default());
        let grant = shared(1, Duration::from_secs(30), Duration::from_secs(30));
        let turn = holds.take("lock-1", None).await.unwrap();
        holds.hold(turn, &grant);
        let last = holds.let_go(&grant);
        assert!(matches!(last, LetGo::Last(Some(_))));
        assert!(
            holds.take("lock-1", soon(0)).await.is_none(),
            "the turn is kept until the release has begun"
        );
        drop(last);
        let next = holds.take("lock-1", soon(0)).await;
        assert!(next.is_some(), "then it passes on");
        drop(next);
        assert_eq!(holds.len(), 0, "nothing left behind");
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_dropped_without_a_grant_passes_on() {
        let holds = Arc::new(Holds::default());
        let turn = holds.take("x", None).await.unwrap();
        drop(turn);
        assert!(holds.take("x", soon(0)).await.is_some());
    }
}
