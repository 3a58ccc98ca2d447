//! Admission: a bounded number of lock API requests in flight per replica.
//! Past the bound a request is refused at once with 503 `overloaded` and
//! `Retry-After`, so overload shows as fast refusals instead of a queue
//! that grows and latency that climbs for everyone. The slots are taken in
//! tiers: acquires and inspects only while fewer than [`ACQUIRE_SHARE`] of
//! them are taken, releases while fewer than [`RELEASE_SHARE`] are, and
//! renewals up to the bound. Every admitted acquire brings a release, which
//! must not be refused then (the name would stay held for a TTL), and
//! renewals, which keep held locks alive, keep a share no surge of
//! acquires and releases can take.
//!
//! Refusals are not logged one by one (see
//! [`failure_log`](super::failure_log)).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::StatusCode;

use super::error::ApiError;
use super::routes::Route;
use crate::metrics as m;

/// Share of the slots acquires and inspects may use: about as many
/// releases follow them, each as long in flight.
pub const ACQUIRE_SHARE: f64 = 0.5;
/// Share of the slots releases may use (acquires' share included); the
/// rest is for renewals alone.
pub const RELEASE_SHARE: f64 = 0.9;

/// Share of the acquire slots one shard may hold when there are several.
pub const SHARD_SHARE: f64 = 0.5;

/// The most acquires one shard may have in flight: half of the acquire
/// slots, so a slow shard leaves the other half to the others.
pub fn per_shard_acquires(max_in_flight: usize) -> usize {
    ((max_in_flight as f64 * ACQUIRE_SHARE * SHARD_SHARE) as usize).max(1)
}

/// The replica's in-flight lock API requests.
pub struct Admission {
    in_flight: AtomicUsize,
    max: usize,
    max_acquires: usize,
    max_releases: usize,
}

/// A slot, given back when dropped.
pub struct Slot<'a> {
    admission: &'a Admission,
}

impl Admission {
    pub fn new(max: usize) -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            max,
            max_acquires: ((max as f64 * ACQUIRE_SHARE) as usize).max(1),
            max_releases: ((max as f64 * RELEASE_SHARE) as usize).max(1),
        }
    }

    /// A slot for `route`, `None` for routes that take none (health,
    /// metrics, admin), or 503 `overloaded` when the bound is reached.
    pub fn admit(&self, route: Route) -> Result<Option<Slot<'_>>, ApiError> {
        let bound = match route {
            Route::Renew | Route::RenewBatch | Route::Extend => self.max,
            Route::Release => self.max_releases,
            Route::Acquire | Route::Inspect => self.max_acquires,
            _ => return Ok(None),
        };
        let taken = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            });
        match taken {
            Ok(n) => {
                m::requests_in_flight(n + 1);
                Ok(Some(Slot { admission: self }))
            }
            Err(n) => Err(ApiError {
                retry_after: Some(Duration::from_secs(1)),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    format!(
                        "this router is serving {n} requests, its limit for {}; retry after a second",
                        route.label()
                    ),
                )
            }),
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let n = self.admission.in_flight.fetch_sub(1, Ordering::AcqRel);
        m::requests_in_flight(n - 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acquires_leave_room_for_releases_and_both_for_renewals() {
        let a = Admission::new(10);
        let acquires: Vec<_> = (0..5)
            .map(|_| a.admit(Route::Acquire).unwrap().unwrap())
            .collect();
        let refused = a.admit(Route::Acquire).err().expect("acquires are at 50%");
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.code, "overloaded");
        assert_eq!(refused.retry_after, Some(Duration::from_secs(1)));
        assert!(
            a.admit(Route::Inspect).is_err(),
            "inspects share the acquires' tier"
        );
        let releases: Vec<_> = (0..4)
            .map(|_| a.admit(Route::Release).unwrap().unwrap())
            .collect();
        assert!(a.admit(Route::Release).is_err(), "releases are at 90%");
        let renewal = a.admit(Route::RenewBatch).unwrap().unwrap();
        assert!(a.admit(Route::Renew).is_err(), "all 10 slots are taken");
        assert!(a.admit(Route::Healthz).unwrap().is_none());
        assert!(a.admit(Route::Metrics).unwrap().is_none());
        drop(renewal);
        drop(releases);
        drop(acquires);
        assert_eq!(a.in_flight.load(Ordering::Acquire), 0);
        assert!(a.admit(Route::Acquire).unwrap().is_some());
    }
}
