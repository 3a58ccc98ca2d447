//! Renewals first: when a shard's renewals slow down, its acquires are
//! refused for a while, before any renewal is.
//!
//! A renewal that takes longer than the budget (`server.renewal_budget_ms`)
//! means the router or the shard is queueing: CPU, etcd's leader, or the
//! network between them. Admitting more acquires there would add txns and
//! session grants to that queue and slow the renewals that keep held locks
//! alive. So once two renewals, and at least a tenth of those that finished
//! in the current quarter second, went over the budget, the shard refuses
//! acquires (503 `overloaded`) for [`SHED_FOR`]; every slow renewal while
//! shedding extends it. Renewals and releases are never refused by this.
//!
//! Besides, the acquires of a shard's names in flight in this replica are
//! counted, so that a bound on them (the lock layer's) keeps one slow shard
//! from taking every slot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a shard sheds acquires after its renewals were found slow.
pub const SHED_FOR: Duration = Duration::from_secs(1);
/// The span over which the share of slow renewals is counted.
const WINDOW: Duration = Duration::from_millis(250);
/// Slow renewals in a window before the shard sheds: one slow renewal (a
/// probe of a lease close to its end, say) is not a queue.
const MIN_SLOW: u32 = 2;

/// A shard's recent renewal latency, as acquires look at it.
#[derive(Default)]
pub struct Pressure {
    /// std `Mutex`: held for a few comparisons, never across an await.
    inner: Mutex<Window>,
}

#[derive(Default)]
struct Window {
    start: Option<Instant>,
    renewals: u32,
    slow: u32,
    shed_until: Option<Instant>,
}

impl Pressure {
    /// A renewal (or renew-batch's part on this shard) took `took`; true if
    /// this made the shard start shedding acquires.
    pub fn renewal(&self, took: Duration, budget: Duration, now: Instant) -> bool {
        if budget.is_zero() {
            return false;
        }
        let mut w = self.inner.lock().expect("pressure lock");
        if w.start
            .is_none_or(|start| now.saturating_duration_since(start) >= WINDOW)
        {
            w.start = Some(now);
            w.renewals = 0;
            w.slow = 0;
        }
        w.renewals += 1;
        if took <= budget {
            return false;
        }
        w.slow += 1;
        if w.slow < MIN_SLOW || w.slow * 10 < w.renewals {
            return false;
        }
        let started = w.shed_until.is_none_or(|until| until <= now);
        w.shed_until = Some(now + SHED_FOR);
        started
    }

    /// Whether acquires of the shard's names are refused now.
    pub fn shedding(&self, now: Instant) -> bool {
        let w = self.inner.lock().expect("pressure lock");
        w.shed_until.is_some_and(|until| until > now)
    }
}

/// Why a shard does not take another acquire now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Busy {
    /// Its renewals are slow, and renewals come first.
    Shedding,
    /// This many acquires are in flight on it through this replica: the
    /// bound.
    Full(usize),
}

/// An acquire in flight on a shard, counted until dropped.
pub struct AcquireSlot<'a>(&'a AtomicUsize);

impl<'a> AcquireSlot<'a> {
    /// One more of the acquires `in_flight` counts, unless `bound` are in
    /// flight already (then their number).
    pub fn take(in_flight: &'a AtomicUsize, bound: usize) -> Result<Self, usize> {
        in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            })
            .map(|_| Self(in_flight))
    }
}

impl Drop for AcquireSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Duration = Duration::from_millis(500);

    #[test]
    fn acquires_are_shed_once_a_tenth_of_the_renewals_are_slow() {
        let p = Pressure::default();
        let t0 = Instant::now();
        let fast = Duration::from_millis(5);
        let slow = Duration::from_millis(800);
        for _ in 0..18 {
            assert!(!p.renewal(fast, BUDGET, t0));
        }
        // One slow renewal is not a queue.
        assert!(!p.renewal(slow, BUDGET, t0));
        assert!(!p.shedding(t0));
        // Two of twenty are.
        assert!(p.renewal(slow, BUDGET, t0));
        assert!(p.shedding(t0));
        assert!(p.shedding(t0 + SHED_FOR - Duration::from_millis(1)));
        // It ends a second after the last slow renewal.
        assert!(!p.shedding(t0 + SHED_FOR));
    }

    #[test]
    fn a_few_slow_renewals_among_many_fast_ones_shed_nothing() {
        let p = Pressure::default();
        let t0 = Instant::now();
        for i in 0..200 {
            let took = Duration::from_millis(if i % 20 == 0 { 900 } else { 3 });
            assert!(!p.renewal(took, BUDGET, t0));
        }
        assert!(!p.shedding(t0));
        // A new window counts afresh.
        let later = t0 + WINDOW;
        p.renewal(Duration::from_secs(1), BUDGET, later);
        assert!(p.renewal(Duration::from_secs(1), BUDGET, later));
    }

    #[test]
    fn a_budget_of_zero_never_sheds() {
        let p = Pressure::default();
        let t0 = Instant::now();
        for _ in 0..10 {
            assert!(!p.renewal(Duration::from_secs(5), Duration::ZERO, t0));
        }
        assert!(!p.shedding(t0));
    }
}
