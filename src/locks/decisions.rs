//! Unit tests of the lock operations' decisions, made over the in-memory
//! shard (`shard/fake.rs`) instead of etcd: what an acquire's check
//! refuses, what an acquire answers (a free name, a held one, the holder's
//! own re-acquire, a lost holder's lock-delay, a principal's quotas, freed
//! again by a release or an expiry, a ring that moved on), what a renewal answers (live, expired, stolen; a
//! stale lockId renews nothing), what an extend moves (the same token on a
//! session of the new TTL; a stale lockId moves nothing), what a release
//! deletes, what an inspect shows, what a force-release takes (and what it
//! spares), what a wait in a name's queue comes to (first come, first
//! served; the caller's own client's grant; its deadline), and how a
//! migration's handoff reads a moved name's previous shard. The real-etcd
//! tests (`tests/`) prove the wiring and the faults; these prove the
//! rules, in milliseconds.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::acquire::{Attempt, Handoff};
use super::*;
use crate::config::LockDelay;
use crate::placement::topology::Router;
use crate::shard::fake::{FakeShard, Lost, IDENTITY, RING};
use crate::shard::keys::{name_hash, Recorded, RingMeta};
use crate::shard::ops::LockShard;
use crate::shard::AcquireTxn;

const TTL: u32 = 10;

fn active() -> Active {
    let settings =
        crate::config::Settings::from_toml(crate::config::tests::MINIMAL).expect("a valid config");
    let router = Router::unconnected(&settings);
    let quotas = Arc::new(Quotas::default());
    Active::new(&settings, router, Sealer::unsigned(), quotas)
}

fn shard(name: &str) -> Arc<FakeShard> {
    Arc::new(FakeShard::new(name))
}

/// An acquire of `name` on `shard` by `client`, acting for `caller`.
fn acquire_as(
    shard: &Arc<FakeShard>,
    caller: Caller<'_>,
    name: &str,
    client: &str,
) -> Acquire<FakeShard> {
    let limits = crate::config::Limits::default();
    Acquire {
        name: LockName::parse(name.into(), &limits).expect("a lock name"),
        shard: shard.clone(),
        ttl: ttl(TTL),
        holder: Holder::new(caller, client),
        owner: owner_of(caller),
        wait_until: None,
        metadata: None,
        received: Instant::now(),
    }
}

/// A TTL of `secs`, as an acquire asks for it.
fn ttl(secs: u32) -> SessionTtl {
    let limits = crate::config::Limits::default();
    SessionTtl::parse(u64::from(secs) * 1_000, &limits).expect("a TTL within the limits")
}

fn acquire(shard: &Arc<FakeShard>, name: &str, client: &str) -> Acquire<FakeShard> {
    acquire_as(shard, Caller::Anyone, name, client)
}

async fn attempt_with(
    active: &Active,
    req: &Acquire<FakeShard>,
    replace_held: Option<i64>,
) -> Result<Attempt, LockError> {
    let k = req.shard.name_keys(&name_hash(req.name.as_str()));
    let g = req.shard.grantable();
    active.attempt(req, &k, &g, replace_held).await
}

async fn attempt(active: &Active, req: &Acquire<FakeShard>) -> Attempt {
    attempt_with(active, req, None)
        .await
        .unwrap_or_else(|e| panic!("the attempt failed: {e}"))
}

fn granted(attempt: Attempt) -> Grant {
    match attempt {
        Attempt::Done(Acquired::Granted(grant)) => grant,
        _ => panic!("expected a grant"),
    }
}

fn refused(attempt: Attempt) -> Expiry {
    match attempt {
        Attempt::Done(Acquired::Held(until)) => until,
        _ => panic!("expected the name held"),
    }
}

fn lock_id(active: &Active, grant: &Grant) -> LockId {
    active
        .sealer
        .open(&grant.lock_id)
        .expect("our own lockId")
        .0
}

/// How far past now `until` is, within a second's slack.
fn about(until: Expiry, secs: u64) -> bool {
    let left = until.0.saturating_duration_since(Instant::now());
    left <= Duration::from_secs(secs) && left + Duration::from_secs(1) >= Duration::from_secs(secs)
}

/// An acquire that breaks a rule is refused by its one check, with the
/// message it always had, before its shard is looked up (this router has
/// no shards: a lookup would panic).
#[test]
fn an_acquire_breaking_a_rule_is_refused_by_its_check() {
    let active = active();
    let ask = |name: &str, ttl_ms, client_id: &str, wait_ms| AcquireRequest {
        name: name.into(),
        ttl_ms,
        client_id: client_id.into(),
        wait_ms,
        metadata: None,
        received: Instant::now(),
    };
    let refusals = [
        (
            ask("", 2_000, "w1", 0),
            "name must be 1 to 512 bytes, got 0",
        ),
        (
            ask("a\tb", 2_000, "w1", 0),
            "name must not contain control characters",
        ),
        (
            ask("order-42", 2_000, "", 0),
            "clientId must be 1 to 256 bytes, got 0",
        ),
        (
            ask("order-42", 1_999, "w1", 0),
            "ttlMs must be 2000 to 3600000, got 1999",
        ),
        (
            ask("order-42", 2_000, "w1", 60_001),
            "waitMs must be at most 60000",
        ),
    ];
    for (req, why) in refusals {
        match active.check_acquire(req, Caller::Anyone) {
            Err(LockError::InvalidArgument(m)) => assert_eq!(m, why),
            Err(e) => panic!("{why}: refused as {e:?}"),
            Ok(_) => panic!("{why}: accepted"),
        }
    }
}

#[tokio::test]
async fn a_free_name_is_granted_on_the_clients_session_under_the_rings_epoch() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let key = shard.lock_key("order-42").expect("the lock key");
    let id = lock_id(&active, &grant);
    assert_eq!((id.shard.as_str(), id.epoch, id.ttl_secs), ("a", 1, TTL));
    assert_eq!(
        (id.revision, id.lease),
        (key.create_revision(), key.lease())
    );
    assert_eq!(Some(grant.fencing_token), id.token());
    assert!(about(grant.expires, u64::from(TTL)));
}

#[tokio::test]
async fn a_held_name_is_refused_until_its_holders_lease_ends() {
    let (active, shard) = (active(), shard("a"));
    granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let until = refused(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    assert!(about(until, u64::from(TTL)));
    // The cache showed it held: the refusal came from a read, no txn.
    assert_eq!(shard.grant_txns(), 1);
}

#[tokio::test]
async fn a_reacquire_by_the_holder_answers_its_own_grant_again() {
    let (active, shard) = (active(), shard("a"));
    let first = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let again = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    assert_eq!(again.fencing_token, first.fencing_token);
    let (a, b) = (lock_id(&active, &first), lock_id(&active, &again));
    assert_eq!((a.revision, a.lease), (b.revision, b.lease));
    assert_eq!(shard.grant_txns(), 1, "idempotent: no second grant");
    // Its answer vouches for the lease it renewed.
    assert_eq!(shard.keepalives(a.lease), 1);
}

#[tokio::test]
async fn a_lost_holders_name_waits_out_its_lock_delay() {
    let (active, shard) = (active(), shard("a"));
    let first = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    // The holder's lease ends without a release: its key goes, its held
    // record stays.
    shard.expire(lock_id(&active, &first).lease);
    let until = refused(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    // One TTL of the lost lock, plus one second for rounding.
    assert!(about(until, u64::from(TTL) + 1));
    // Still delayed for the next one, and no grant meanwhile.
    refused(attempt(&active, &acquire(&shard, "order-42", "w3")).await);
    assert!(shard.lock_key("order-42").is_none());
}

#[tokio::test]
async fn with_lock_delay_off_a_lost_holders_record_is_replaced_at_once() {
    let (mut active, shard) = (active(), shard("a"));
    active.lock_delay = LockDelay::Off;
    let first = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    shard.expire(lock_id(&active, &first).lease);
    let req = acquire(&shard, "order-42", "w2");
    assert!(matches!(attempt(&active, &req).await, Attempt::Again));
    let k = shard.name_keys(&name_hash("order-42"));
    let record = active.lost_record(&*shard, &k).await.expect("a read");
    assert!(record.is_some(), "the lost holder's record, to replace");
    let second = granted(attempt_with(&active, &req, record).await.expect("grants"));
    assert!(second.fencing_token > first.fencing_token);
}

#[tokio::test]
async fn a_principal_at_its_max_held_locks_is_refused_before_any_txn() {
    let (active, shard) = (active(), shard("a"));
    let quota = Quota {
        max_held_locks: 1,
        max_sessions: 0,
    };
    let pay = Caller::Principal { name: "pay", quota };
    granted(attempt(&active, &acquire_as(&shard, pay, "order-1", "w1")).await);
    // The shard's cache counts the grant.
    let second = attempt_with(&active, &acquire_as(&shard, pay, "order-2", "w1"), None).await;
    assert!(matches!(second, Err(LockError::PermissionDenied(_))));
    assert_eq!(shard.grant_txns(), 1);
    // Another principal is not held to it.
    let ship = Caller::Principal {
        name: "ship",
        quota,
    };
    granted(attempt(&active, &acquire_as(&shard, ship, "order-2", "w1")).await);
}

#[tokio::test]
async fn a_principal_at_its_max_sessions_gets_no_new_session_but_uses_its_own() {
    let (active, shard) = (active(), shard("a"));
    let quota = Quota {
        max_held_locks: 0,
        max_sessions: 1,
    };
    let pay = Caller::Principal { name: "pay", quota };
    granted(attempt(&active, &acquire_as(&shard, pay, "order-1", "w1")).await);
    let other = attempt_with(&active, &acquire_as(&shard, pay, "order-2", "w2"), None).await;
    assert!(matches!(other, Err(LockError::PermissionDenied(_))));
    // The session w1 has takes more locks.
    granted(attempt(&active, &acquire_as(&shard, pay, "order-3", "w1")).await);
}

/// `pay`, a principal with `quota`.
fn pay(quota: Quota) -> Caller<'static> {
    Caller::Principal { name: "pay", quota }
}

fn denied(answer: Result<Attempt, LockError>) -> bool {
    matches!(answer, Err(LockError::PermissionDenied(_)))
}

/// A grant txn whose answer is lost (docs/design.md, "An acquire that was
/// not answered"): the router moves the grant cut-off past it and asks
/// again. Held on its way, the txn lands after the move and grants
/// nothing, while the caller was granted afresh; applied before its answer
/// was lost, the next attempt answers that very grant. A shard that
/// cannot take the move leaves the caller a 503, and a move another
/// acquire made since is not made again.
#[tokio::test]
async fn an_acquire_whose_answer_was_lost_is_resolved_and_its_late_txn_grants_nothing() {
    let (active, shard) = (active(), shard("a"));
    // Held on its way: the retry grants, and the late txn grants nothing.
    shard.lose_next_answer(Lost::Held);
    let req = acquire(&shard, "order-7", "w1");
    assert!(matches!(attempt(&active, &req).await, Attempt::CutoffMoved));
    assert_eq!(shard.cutoff_moves(), 1);
    let grant = granted(attempt(&active, &req).await);
    let key = shard.lock_key("order-7").expect("held");
    assert_eq!(key.create_revision(), lock_id(&active, &grant).revision);
    // The caller is done with it; the txn lands on the free name.
    release(&active, &shard, &grant).await;
    assert!(matches!(shard.land_held_txn(), AcquireTxn::CutoffMoved(_)));
    assert!(
        shard.lock_key("order-7").is_none(),
        "a grant nobody knows of"
    );
    // Another replica's txn that compared the old cut-off is refused too,
    // and it learns the new one.
    let mut stale = shard.grantable();
    stale.cutoff = 0;
    let k = shard.name_keys(&name_hash("order-8"));
    let other = acquire(&shard, "order-8", "w2");
    let answer = active.attempt(&other, &k, &stale, None).await;
    assert!(matches!(answer, Ok(Attempt::CutoffMoved)));
    assert!(shard.lock_key("order-8").is_none());
    granted(attempt(&active, &other).await);

    // Applied before its answer was lost: the attempt answers that grant,
    // read once the cut-off moved.
    shard.lose_next_answer(Lost::Applied);
    let req = acquire(&shard, "order-9", "w1");
    let before = shard.cutoff_moves();
    let grant = granted(attempt(&active, &req).await);
    assert_eq!(shard.cutoff_moves(), before + 1);
    let made = shard
        .lock_key("order-9")
        .expect("granted before the answer was lost");
    assert_eq!(lock_id(&active, &grant).revision, made.create_revision());

    // A move made since the txn was sent is enough: none of its own.
    shard.lose_next_answer(Lost::Held);
    let k = shard.name_keys(&name_hash("order-10"));
    let late = acquire(&shard, "order-10", "w1");
    let moves = shard.cutoff_moves();
    let answer = active.attempt(&late, &k, &stale, None).await;
    assert!(matches!(answer, Ok(Attempt::CutoffMoved)));
    assert_eq!(shard.cutoff_moves(), moves, "moved again");
    assert!(matches!(shard.land_held_txn(), AcquireTxn::CutoffMoved(_)));

    // A shard that answers nobody: 503, and no grant.
    shard.cutoff_unreachable(true);
    shard.lose_next_answer(Lost::Held);
    let req = acquire(&shard, "order-11", "w1");
    let answer = attempt_with(&active, &req, None).await;
    assert!(
        matches!(answer, Err(LockError::ShardUnavailable { .. })),
        "{:?}",
        answer.err()
    );
    assert!(shard.lock_key("order-11").is_none());
}

/// A grant txn applied but unanswered, on a shard whose plain reads then
/// go unanswered for a while too (a follower back from a cut answers no
/// linearizable read for seconds on etcd 3.4): once the cut-off moved, the
/// read that settles the txn's outcome answers the acquire its grant, in
/// the same attempt. Never an error while the client holds the name: it
/// might never ask again, and its other locks would keep the name.
#[tokio::test]
async fn an_acquire_whose_answer_was_lost_is_answered_its_grant_while_reads_fail() {
    let (active, shard) = (active(), shard("a"));
    shard.lose_next_answer(Lost::Applied);
    shard.lose_reads_with_answer(5);
    let req = acquire(&shard, "order-7", "w1");
    let grant = granted(attempt(&active, &req).await);
    let key = shard
        .lock_key("order-7")
        .expect("granted before the answer was lost");
    assert_eq!(lock_id(&active, &grant).revision, key.create_revision());
    assert_eq!(shard.cutoff_moves(), 1);
}

/// A grant txn answered while the keepalive sent beside it went
/// unanswered: the grant stands (its key is on the session lease), and it
/// is answered with the expiry the lease's last confirmed renewal vouches
/// for, not an error. So is the client's re-acquire of a lock it holds.
#[tokio::test]
async fn a_grant_whose_keepalive_went_unanswered_is_answered_by_its_last_renewal() {
    let (active, shard) = (active(), shard("a"));
    let first = granted(attempt(&active, &acquire(&shard, "order-1", "w1")).await);
    shard.lose_keepalives(true);
    let req = acquire(&shard, "order-2", "w1");
    let grant = granted(attempt(&active, &req).await);
    let key = shard.lock_key("order-2").expect("granted");
    assert_eq!(lock_id(&active, &grant).revision, key.create_revision());
    assert_eq!(
        lock_id(&active, &grant).lease,
        lock_id(&active, &first).lease
    );
    assert!(
        about(grant.expires, 10),
        "as the session's last renewal vouches"
    );
    let again = granted(attempt(&active, &acquire(&shard, "order-1", "w1")).await);
    assert_eq!(again.fencing_token, first.fencing_token);
    // A lease with no confirmed renewal left to vouch for it is an error.
    let other = shard.lock_key("order-1").expect("held").lease();
    shard.forget_confirmed(other);
    let answer = attempt_with(&active, &acquire(&shard, "order-1", "w1"), None).await;
    assert!(matches!(answer, Err(LockError::ShardUnavailable { .. })));
}

/// A grant's reservation fills the quota until the shard's cache counts
/// the grant, and until then the cache does not show the name held: the
/// holder's own re-acquire (a retry of an acquire it won) is read and
/// answered with its grant, not refused by its quota, and so is a new
/// session's TTL (`max_sessions`); another client of the principal is
/// told the name is held. A new name is still refused.
#[tokio::test]
async fn a_re_acquire_is_not_refused_by_a_quota_its_own_grant_fills() {
    for quota in [
        Quota {
            max_held_locks: 1,
            max_sessions: 0,
        },
        Quota {
            max_held_locks: 0,
            max_sessions: 1,
        },
    ] {
        let (active, shard) = (active(), shard("a"));
        let pay = pay(quota);
        shard.hold_cache();
        let first = granted(attempt(&active, &acquire_as(&shard, pay, "order-1", "w1")).await);
        let mut again = acquire_as(&shard, pay, "order-1", "w1");
        let retried = granted(attempt(&active, &again).await);
        assert_eq!(retried.fencing_token, first.fencing_token, "{quota:?}");
        // Another TTL would need another session: still the same grant.
        again.ttl = ttl(2 * TTL);
        let other_ttl = granted(attempt(&active, &again).await);
        assert_eq!(other_ttl.fencing_token, first.fencing_token, "{quota:?}");
        let by_other = acquire_as(&shard, pay, "order-1", "w2");
        refused(attempt(&active, &by_other).await);
        let new_name = if quota.max_held_locks > 0 {
            acquire_as(&shard, pay, "order-2", "w1")
        } else {
            acquire_as(&shard, pay, "order-2", "w2")
        };
        assert!(
            denied(attempt_with(&active, &new_name, None).await),
            "{quota:?}"
        );
        // At max_held_locks every one was answered before any txn; at
        // max_sessions the retry on its own session went on to the txn,
        // which found its grant.
        let txns = if quota.max_held_locks > 0 { 1 } else { 2 };
        assert_eq!(shard.grant_txns(), txns, "{quota:?}");
        // Counted by the cache now (the reservation given back): the same.
        shard.catch_up_cache();
        assert!(
            denied(attempt_with(&active, &new_name, None).await),
            "{quota:?}"
        );
        let retried = granted(attempt(&active, &acquire_as(&shard, pay, "order-1", "w1")).await);
        assert_eq!(retried.fencing_token, first.fencing_token, "{quota:?}");
    }
}

#[tokio::test]
async fn a_principals_released_lock_no_longer_counts_in_its_max_held_locks() {
    let (active, shard) = (active(), shard("a"));
    let pay = pay(Quota {
        max_held_locks: 2,
        max_sessions: 0,
    });
    let one = granted(attempt(&active, &acquire_as(&shard, pay, "order-1", "w1")).await);
    granted(attempt(&active, &acquire_as(&shard, pay, "order-2", "w2")).await);
    let third = acquire_as(&shard, pay, "order-3", "w1");
    assert!(denied(attempt_with(&active, &third, None).await));
    release(&active, &shard, &one).await;
    granted(attempt(&active, &third).await);
    // At its bound again.
    let fourth = acquire_as(&shard, pay, "order-4", "w1");
    assert!(denied(attempt_with(&active, &fourth, None).await));
    assert_eq!(shard.grant_txns(), 3);
}

#[tokio::test]
async fn a_principals_expired_lock_no_longer_counts_in_its_max_held_locks() {
    let (active, shard) = (active(), shard("a"));
    let pay = pay(Quota {
        max_held_locks: 1,
        max_sessions: 0,
    });
    let lost = granted(attempt(&active, &acquire_as(&shard, pay, "order-1", "w1")).await);
    let next = acquire_as(&shard, pay, "order-2", "w1");
    assert!(denied(attempt_with(&active, &next, None).await));
    // Its lease ends: the key goes, and the cache uncounts it.
    shard.expire(lock_id(&active, &lost).lease);
    granted(attempt(&active, &next).await);
}

#[tokio::test]
async fn a_session_holding_no_lock_no_longer_counts_in_max_sessions() {
    let (active, shard) = (active(), shard("a"));
    let pay = pay(Quota {
        max_held_locks: 0,
        max_sessions: 1,
    });
    let one = granted(attempt(&active, &acquire_as(&shard, pay, "order-1", "w1")).await);
    let other = acquire_as(&shard, pay, "order-2", "w2");
    assert!(denied(attempt_with(&active, &other, None).await));
    // Counted are the sessions locks ride on: w1's holds none once released.
    release(&active, &shard, &one).await;
    let two = granted(attempt(&active, &other).await);
    assert_ne!(lock_id(&active, &one).lease, lock_id(&active, &two).lease);
    // w2's is the one now: a third client gets no session.
    let again = acquire_as(&shard, pay, "order-3", "w3");
    assert!(denied(attempt_with(&active, &again, None).await));
}

#[tokio::test]
async fn a_shard_recording_another_ring_or_identity_grants_nothing() {
    let (active, shard) = (active(), shard("a"));
    let req = acquire(&shard, "order-42", "w1");
    let k = shard.name_keys(&name_hash("order-42"));
    let g = shard.grantable();
    let moved_on = Recorded::new(RingMeta {
        epoch: 2,
        ring: "another-ring".into(),
        previous: None,
    });
    shard.set_ring(moved_on.clone());
    let answer = active.attempt(&req, &k, &g, None).await;
    assert!(matches!(answer, Ok(Attempt::RingChanged(Some(r))) if r == moved_on));
    let other = Grantable {
        ring: moved_on,
        identity: b"another cluster".to_vec(),
        cutoff: 0,
    };
    let answer = active.attempt(&req, &k, &other, None).await;
    assert!(matches!(answer, Ok(Attempt::IdentityChanged)));
    assert!(shard.lock_key("order-42").is_none());
}

#[tokio::test]
async fn a_queued_name_is_not_granted_to_a_caller_that_does_not_wait() {
    let (active, shard) = (active(), shard("a"));
    shard.queue_waiter("order-42");
    refused(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    assert!(shard.lock_key("order-42").is_none());
}

/// Renews the lock `grant` names on `shard` (a single renew).
async fn renew(active: &Active, shard: &FakeShard, grant: &Grant) -> RenewOutcome {
    let id = lock_id(active, grant);
    let mut outcomes = active.renew_on(shard, &[&id], false).await;
    outcomes.pop().expect("one outcome").expect("no etcd error")
}

#[tokio::test]
async fn a_live_lock_renews_for_no_more_than_its_ttl() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let RenewOutcome::Renewed(until) = renew(&active, &shard, &grant).await else {
        panic!("expected renewed");
    };
    assert!(about(until, u64::from(TTL)));
}

#[tokio::test]
async fn an_expired_lock_is_answered_expired() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    shard.expire(lock_id(&active, &grant).lease);
    assert!(matches!(
        renew(&active, &shard, &grant).await,
        RenewOutcome::Expired
    ));
}

#[tokio::test]
async fn a_stale_lock_id_never_renews_a_later_holders_lock() {
    let (active, shard) = (active(), shard("a"));
    let old = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    active
        .release_on(&*shard, &lock_id(&active, &old))
        .await
        .expect("released");
    // Another client holds the name now.
    let later = granted(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    let lease = lock_id(&active, &later).lease;
    assert!(matches!(
        renew(&active, &shard, &old).await,
        RenewOutcome::Stolen
    ));
    assert_eq!(shard.keepalives(lease), 0, "no keepalive on its word");
    // The same client again, on the same session lease: the old lockId
    // names that lease but not the new grant's revision.
    active
        .release_on(&*shard, &lock_id(&active, &later))
        .await
        .expect("released");
    let mine = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let (before, now) = (lock_id(&active, &old), lock_id(&active, &mine));
    assert_eq!(before.lease, now.lease);
    let keepalives = shard.keepalives(now.lease);
    assert!(matches!(
        renew(&active, &shard, &old).await,
        RenewOutcome::Stolen
    ));
    assert_eq!(shard.keepalives(now.lease), keepalives);
}

#[tokio::test]
async fn a_release_deletes_only_the_grant_its_lock_id_names() {
    let (active, shard) = (active(), shard("a"));
    let old = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let old_id = lock_id(&active, &old);
    active.release_on(&*shard, &old_id).await.expect("released");
    assert!(shard.lock_key("order-42").is_none());
    // Released, not lost: the next client gets the name at once.
    let later = granted(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    // Releasing again with the old lockId answers as done, and touches
    // nothing of the later grant.
    active.release_on(&*shard, &old_id).await.expect("a no-op");
    let key = shard.lock_key("order-42").expect("still held");
    assert_eq!(key.create_revision(), lock_id(&active, &later).revision);
}

/// A migration whose ring is [`RING`] at `epoch`: what the previous shard
/// must record to be fenced.
const FENCE: (&str, u64) = (RING, 1);

async fn handoff(
    active: &Active,
    previous: &FakeShard,
    client: &str,
    fence: (&str, u64),
) -> Result<Handoff, LockError> {
    let pk = previous.name_keys(&name_hash("order-42"));
    (active.handoff_on(previous, client, &pk, IDENTITY, fence)).await
}

#[tokio::test]
async fn a_moved_name_free_on_its_previous_shard_is_left_to_the_new_one() {
    let (active, previous) = (active(), shard("old"));
    let found = handoff(&active, &previous, "w1", FENCE).await;
    assert!(matches!(found, Ok(Handoff::Free)));
}

#[tokio::test]
async fn a_moved_name_held_on_its_previous_shard_stays_its_holders() {
    let (active, previous) = (active(), shard("old"));
    let grant = granted(attempt(&active, &acquire(&previous, "order-42", "w1")).await);
    let other = handoff(&active, &previous, "w2", FENCE).await;
    assert!(matches!(other, Ok(Handoff::Answered(Acquired::Held(_)))));
    // Its holder's re-acquire is answered from there: the same grant.
    let own = handoff(&active, &previous, "w1", FENCE).await;
    let Ok(Handoff::Answered(Acquired::Granted(again))) = own else {
        panic!("expected the holder's own grant");
    };
    assert_eq!(again.fencing_token, grant.fencing_token);
    assert_eq!(lock_id(&active, &again).shard, "old");
}

#[tokio::test]
async fn a_moved_names_lost_holder_on_its_previous_shard_delays_it_there() {
    let (active, previous) = (active(), shard("old"));
    let grant = granted(attempt(&active, &acquire(&previous, "order-42", "w1")).await);
    previous.expire(lock_id(&active, &grant).lease);
    let found = handoff(&active, &previous, "w2", FENCE).await;
    assert!(
        matches!(found, Ok(Handoff::Answered(Acquired::Held(until))) if about(until, u64::from(TTL) + 1))
    );
    // Delayed there from now on.
    let found = handoff(&active, &previous, "w2", FENCE).await;
    assert!(matches!(found, Ok(Handoff::Answered(Acquired::Held(_)))));
}

#[tokio::test]
async fn with_lock_delay_off_a_moved_names_lost_holder_leaves_it_free() {
    let (mut active, previous) = (active(), shard("old"));
    active.lock_delay = LockDelay::Off;
    let grant = granted(attempt(&active, &acquire(&previous, "order-42", "w1")).await);
    previous.expire(lock_id(&active, &grant).lease);
    let found = handoff(&active, &previous, "w2", FENCE).await;
    assert!(matches!(found, Ok(Handoff::Free)));
}

#[tokio::test]
async fn a_previous_shard_not_yet_fenced_or_not_itself_answers_nothing() {
    let (active, previous) = (active(), shard("old"));
    // It records an older epoch than the migration's: it could still grant.
    let unfenced = handoff(&active, &previous, "w1", (RING, 2)).await;
    assert!(matches!(unfenced, Err(LockError::ShardUnavailable { .. })));
    let other_ring = handoff(&active, &previous, "w1", ("another-ring", 1)).await;
    assert!(matches!(
        other_ring,
        Err(LockError::ShardUnavailable { .. })
    ));
    let pk = previous.name_keys(&name_hash("order-42"));
    let not_itself = (active.handoff_on(&*previous, "w1", &pk, b"another cluster", FENCE)).await;
    assert!(matches!(not_itself, Ok(Handoff::IdentityChanged)));
}

/// The router's word on a fake shard: it may grant, and no migration
/// moved the name.
struct Serving(Arc<FakeShard>);

impl super::wait::Standing for Serving {
    fn grantable(&self) -> Result<Grantable, LockError> {
        Ok(self.0.grantable())
    }

    fn moved(&self) -> bool {
        false
    }

    fn ring_changed(&self, _found: Option<Recorded>) {}

    fn identity_changed(&self) {}
}

/// `client` waits up to `wait` in the queue of `order-42`, as a task.
fn wait_in_queue(
    active: &Arc<Active>,
    shard: &Arc<FakeShard>,
    client: &'static str,
    wait: Duration,
) -> tokio::task::JoinHandle<Result<Option<Acquired>, LockError>> {
    let (active, shard) = (active.clone(), shard.clone());
    tokio::spawn(async move {
        let mut req = acquire(&shard, "order-42", client);
        req.wait_until = Some(Instant::now() + wait);
        let standing = Serving(shard.clone());
        (active.queue(&req, &standing)).await
    })
}

/// Lets the waiters run until `n` of them are queued for `order-42`.
async fn until_queued(shard: &FakeShard, n: usize) {
    for _ in 0..1_000 {
        if shard.queued("order-42") == n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{} waiters queued, not {n}", shard.queued("order-42"));
}

async fn waited(task: tokio::task::JoinHandle<Result<Option<Acquired>, LockError>>) -> Acquired {
    match task.await.expect("the waiter's task") {
        Ok(Some(answer)) => answer,
        Ok(None) => panic!("the name moved"),
        Err(e) => panic!("the wait failed: {e}"),
    }
}

async fn release(active: &Active, shard: &FakeShard, grant: &Grant) {
    let id = lock_id(active, grant);
    active.release_on(shard, &id).await.expect("released");
}

fn grant_of(answer: Acquired) -> Grant {
    match answer {
        Acquired::Granted(grant) => grant,
        Acquired::Held(_) => panic!("expected a grant"),
    }
}

#[tokio::test]
async fn waiters_get_the_name_in_the_order_they_queued() {
    let (active, shard) = (Arc::new(active()), shard("a"));
    let holder = granted(attempt(&active, &acquire(&shard, "order-42", "h")).await);
    let first = wait_in_queue(&active, &shard, "w1", Duration::from_secs(5));
    until_queued(&shard, 1).await;
    let second = wait_in_queue(&active, &shard, "w2", Duration::from_secs(5));
    until_queued(&shard, 2).await;
    release(&active, &shard, &holder).await;
    let one = grant_of(waited(first).await);
    assert_eq!(shard.queued("order-42"), 1, "the second still waits");
    release(&active, &shard, &one).await;
    let two = grant_of(waited(second).await);
    assert!(two.fencing_token > one.fencing_token);
    assert_eq!(shard.queued("order-42"), 0);
}

/// A waiter whose entry's txn found another entry ahead sends no grant
/// txn (it would fail, and cost a raft write) until that entry leaves;
/// woken then, it reads first, and sends none while the name is held (here
/// by the waiter ahead, just granted). At the head, the release grants it.
#[tokio::test]
async fn a_waiter_behind_another_sends_no_grant_txn_while_it_could_only_fail() {
    let (active, shard) = (Arc::new(active()), shard("a"));
    let holder = granted(attempt(&active, &acquire(&shard, "order-42", "h")).await);
    let settle = || async {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    };
    let first = wait_in_queue(&active, &shard, "w1", Duration::from_secs(5));
    until_queued(&shard, 1).await;
    settle().await; // the first waiter's txn found the name held
    let sent = shard.grant_txns();
    let second = wait_in_queue(&active, &shard, "w2", Duration::from_secs(5));
    until_queued(&shard, 2).await;
    settle().await;
    assert_eq!(shard.grant_txns(), sent, "queued behind another");
    release(&active, &shard, &holder).await;
    let one = grant_of(waited(first).await);
    settle().await; // the second woke: the entry ahead of it left
    assert_eq!(shard.grant_txns(), sent + 1, "only the first's grant");
    assert_eq!(shard.queued("order-42"), 1);
    release(&active, &shard, &one).await;
    let two = grant_of(waited(second).await);
    assert!(two.fencing_token > one.fencing_token);
    assert_eq!(shard.grant_txns(), sent + 2);
    assert_eq!(shard.queued("order-42"), 0);
}

/// A waiter's grant txn whose answer is lost, as a plain acquire's
/// (`an_acquire_whose_answer_was_lost_is_resolved_and_its_late_txn_grants_nothing`):
/// the router moves the grant cut-off past it, then reads the name.
/// Applied before its answer was lost, the waiter is answered that grant;
/// held on its way, it waits on and is granted by its next txn.
#[tokio::test]
async fn a_waiters_grant_whose_answer_was_lost_is_answered_or_granted_again() {
    let (active, shard) = (Arc::new(active()), shard("a"));
    for (round, lost) in [Lost::Applied, Lost::Held].into_iter().enumerate() {
        let holder = granted(attempt(&active, &acquire(&shard, "order-42", "h")).await);
        let waiter = wait_in_queue(&active, &shard, "w1", Duration::from_secs(5));
        until_queued(&shard, 1).await;
        shard.lose_next_answer(lost);
        release(&active, &shard, &holder).await;
        let grant = grant_of(waited(waiter).await);
        let key = shard.lock_key("order-42").expect("held by the waiter");
        assert_eq!(key.create_revision(), lock_id(&active, &grant).revision);
        assert!(grant.fencing_token > holder.fencing_token, "{lost:?}");
        assert_eq!(shard.cutoff_moves(), round as u32 + 1, "{lost:?}");
        assert_eq!(shard.queued("order-42"), 0, "{lost:?}");
        release(&active, &shard, &grant).await;
    }
}

/// A waiter's grant txn applied but unanswered while reads fail too, and a
/// waiter's grant whose keepalive went unanswered: each is answered its
/// grant (`an_acquire_whose_answer_was_lost_is_answered_its_grant_while_reads_fail`).
#[tokio::test]
async fn a_waiters_grant_is_answered_as_such_when_the_calls_after_its_txn_fail() {
    let (active, shard) = (Arc::new(active()), shard("a"));
    for round in ["reads", "keepalives"] {
        let holder = granted(attempt(&active, &acquire(&shard, "order-42", "h")).await);
        let waiter = wait_in_queue(&active, &shard, "w1", Duration::from_secs(5));
        until_queued(&shard, 1).await;
        match round {
            "reads" => {
                shard.lose_next_answer(Lost::Applied);
                shard.lose_reads_with_answer(5);
            }
            _ => shard.lose_keepalives(true),
        }
        release(&active, &shard, &holder).await;
        let grant = grant_of(waited(waiter).await);
        let key = shard.lock_key("order-42").expect("held by the waiter");
        assert_eq!(
            key.create_revision(),
            lock_id(&active, &grant).revision,
            "{round}"
        );
        shard.lose_keepalives(false);
        release(&active, &shard, &grant).await;
    }
}

/// A waiter whose client's session lease ends early (etcd's lease bugs,
/// an operator's revoke) keeps its place and is granted the name, on a new
/// session, when the holder releases it.
#[tokio::test]
async fn a_waiter_whose_session_ends_early_waits_on_on_a_new_one() {
    let (active, shard) = (Arc::new(active()), shard("a"));
    let holder = granted(attempt(&active, &acquire(&shard, "order-42", "h")).await);
    let req = acquire(&shard, "order-42", "w1");
    let first = active.waiting_session(&req).await.expect("a session");
    let waiter = wait_in_queue(&active, &shard, "w1", Duration::from_secs(5));
    until_queued(&shard, 1).await;
    shard.expire(first.id);
    release(&active, &shard, &holder).await;
    let grant = grant_of(waited(waiter).await);
    let lease = lock_id(&active, &grant).lease;
    assert_ne!(lease, first.id, "granted on the session that ended");
    let key = shard.lock_key("order-42").expect("held by the waiter");
    assert_eq!(key.lease(), lease);
    assert_eq!(shard.queued("order-42"), 0);
    release(&active, &shard, &grant).await;
}

#[tokio::test]
async fn a_waiter_whose_own_client_got_the_name_is_answered_that_grant() {
    let (active, shard) = (Arc::new(active()), shard("a"));
    let holder = granted(attempt(&active, &acquire(&shard, "order-42", "h")).await);
    // Two requests of one client wait; the first is granted the name.
    let first = wait_in_queue(&active, &shard, "w1", Duration::from_secs(5));
    until_queued(&shard, 1).await;
    let second = wait_in_queue(&active, &shard, "w1", Duration::from_secs(5));
    until_queued(&shard, 2).await;
    release(&active, &shard, &holder).await;
    let one = grant_of(waited(first).await);
    let two = grant_of(waited(second).await);
    assert_eq!(two.fencing_token, one.fencing_token);
    assert_eq!(shard.queued("order-42"), 0);
}

#[tokio::test]
async fn a_waiter_gives_up_at_its_deadline_and_leaves_the_queue() {
    let (active, shard) = (Arc::new(active()), shard("a"));
    granted(attempt(&active, &acquire(&shard, "order-42", "h")).await);
    let waiter = wait_in_queue(&active, &shard, "w1", Duration::from_millis(30));
    let Acquired::Held(until) = waited(waiter).await else {
        panic!("expected the name held");
    };
    // Answered with the holder's expiry, and its entry is gone.
    assert!(about(until, u64::from(TTL)));
    assert_eq!(shard.queued("order-42"), 0);
}

/// Extends the lock `grant` names on `shard` to `ttl_secs`, on a shard
/// that is what the router verified.
async fn extend(active: &Active, shard: &FakeShard, grant: &Grant, ttl_secs: u32) -> Extended {
    let id = lock_id(active, grant);
    let sealed = (grant.lock_id.as_str(), grant.fencing_token);
    let verified = || panic!("the shard is the one verified");
    (active.extend_on(shard, &id, sealed, ttl(ttl_secs), None, verified))
        .await
        .unwrap_or_else(|e| panic!("the extend failed: {e}"))
}

#[tokio::test]
async fn an_extended_lock_keeps_its_token_on_a_session_of_its_new_ttl() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let before = lock_id(&active, &grant);
    let Extended::Moved(moved) = extend(&active, &shard, &grant, 30).await else {
        panic!("expected the lock moved");
    };
    assert_eq!(moved.fencing_token, grant.fencing_token);
    assert!(about(moved.expires, 30));
    let after = lock_id(&active, &moved);
    assert_eq!((after.ttl_secs, after.revision), (30, before.revision));
    assert_ne!(after.lease, before.lease);
    let key = shard.lock_key("order-42").expect("still held");
    assert_eq!(
        (key.create_revision(), key.lease()),
        (before.revision, after.lease)
    );
    // The old lockId names a lease the lock no longer rides on.
    assert!(matches!(
        renew(&active, &shard, &grant).await,
        RenewOutcome::Stolen
    ));
    let RenewOutcome::Renewed(until) = renew(&active, &shard, &moved).await else {
        panic!("expected the new lockId renewed");
    };
    assert!(about(until, 30));
    // Lost from now on, it is delayed for its new TTL.
    shard.expire(after.lease);
    let until = refused(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    assert!(about(until, 31));
}

/// An extend's move whose answer is lost (docs/design.md, "An acquire
/// that was not answered", and "Extend"): the router moves the grant
/// cut-off past it and reads the lock again. Applied before its answer was
/// lost, the answer is that move (the new lockId, the same token); held on
/// its way (it can no longer land), the next move is made and answered.
/// Either way the holder learns where its lock is, and no move of it can
/// land later behind its back.
#[tokio::test]
async fn an_extend_whose_move_went_unanswered_is_answered_where_the_lock_is() {
    let (active, shard) = (active(), shard("a"));
    for (round, lost) in [Lost::Applied, Lost::Held].into_iter().enumerate() {
        let name = format!("order-{round}");
        let grant = granted(attempt(&active, &acquire(&shard, &name, "w1")).await);
        let before = lock_id(&active, &grant);
        shard.lose_next_answer(lost);
        let Extended::Moved(moved) = extend(&active, &shard, &grant, 30).await else {
            panic!("{lost:?}: expected the lock moved");
        };
        assert_eq!(moved.fencing_token, grant.fencing_token, "{lost:?}");
        let after = lock_id(&active, &moved);
        let key = shard.lock_key(&name).expect("still held");
        assert_eq!(
            (key.create_revision(), key.lease()),
            (before.revision, after.lease),
            "{lost:?}"
        );
        assert_eq!(shard.cutoff_moves(), round as u32 + 1, "{lost:?}");
        let RenewOutcome::Renewed(_) = renew(&active, &shard, &moved).await else {
            panic!("{lost:?}: expected the new lockId renewed");
        };
    }
}

/// An extend whose move was applied but unanswered, on a shard whose plain
/// reads then go unanswered too: the read that settles the move answers
/// it (the new lockId), not an error while the lock sits on a lease its
/// holder does not know of.
#[tokio::test]
async fn an_extend_whose_move_went_unanswered_is_answered_it_while_reads_fail() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-1", "w1")).await);
    shard.lose_next_answer(Lost::Applied);
    shard.lose_reads_with_answer(5);
    let id = lock_id(&active, &grant);
    let sealed = (grant.lock_id.as_str(), grant.fencing_token);
    let verified = || panic!("the shard is the one verified");
    let answer = (active.extend_on(&*shard, &id, sealed, ttl(30), None, verified)).await;
    let Ok(Extended::Moved(moved)) = answer else {
        panic!("expected the move answered: {:?}", answer.err());
    };
    let key = shard.lock_key("order-1").expect("still held");
    assert_eq!(key.lease(), lock_id(&active, &moved).lease);
    assert_eq!(moved.fencing_token, grant.fencing_token);
}

#[tokio::test]
async fn an_extend_to_the_same_ttl_renews_under_the_same_lock_id() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let Extended::Moved(again) = extend(&active, &shard, &grant, TTL).await else {
        panic!("expected the lock renewed");
    };
    assert_eq!(again.lock_id, grant.lock_id);
    assert_eq!(again.fencing_token, grant.fencing_token);
    assert!(about(again.expires, u64::from(TTL)));
    assert_eq!(shard.keepalives(lock_id(&active, &grant).lease), 1);
}

#[tokio::test]
async fn an_extend_of_a_stale_lock_id_refuses_and_renews_or_moves_nothing() {
    let (active, shard) = (active(), shard("a"));
    let old = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    release(&active, &shard, &old).await;
    assert!(matches!(
        extend(&active, &shard, &old, 30).await,
        Extended::Refused(RenewOutcome::Expired)
    ));
    let later = granted(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    let key = shard.lock_key("order-42").expect("held by w2");
    for ttl in [30, TTL] {
        assert!(matches!(
            extend(&active, &shard, &old, ttl).await,
            Extended::Refused(RenewOutcome::Stolen)
        ));
    }
    assert_eq!(shard.lock_key("order-42"), Some(key));
    let lease = lock_id(&active, &later).lease;
    assert_eq!(shard.keepalives(lease), 0, "no keepalive on its word");
}

#[tokio::test]
async fn an_extend_on_a_shard_that_is_not_itself_moves_nothing() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    shard.set_identity(b"another cluster");
    let id = lock_id(&active, &grant);
    let told = std::cell::Cell::new(false);
    let sealed = (grant.lock_id.as_str(), grant.fencing_token);
    let answer = active.extend_on(&*shard, &id, sealed, ttl(30), None, || told.set(true));
    assert!(matches!(
        answer.await,
        Err(LockError::ShardUnavailable { .. })
    ));
    assert!(told.get(), "the router is told");
    assert_eq!(shard.lock_key("order-42").expect("held").lease(), id.lease);
}

/// What inspect answers of `name` on `shard`, its own shard.
async fn inspect(active: &Active, shard: &FakeShard, name: &str) -> Inspection {
    let hash = name_hash(name);
    let state = shard.read_name(&shard.name_keys(&hash)).await;
    let lock = state.expect("a read").lock;
    (active.inspect_on(shard, shard, &hash, lock))
        .await
        .unwrap_or_else(|e| panic!("the inspect failed: {e}"))
}

#[tokio::test]
async fn inspect_shows_the_holder_its_token_expiry_and_metadata() {
    let (active, shard) = (active(), shard("a"));
    let mut req = acquire(&shard, "order-42", "w1");
    req.metadata = Some(serde_json::json!({ "job": 7 }));
    let asked = SystemTime::now();
    let grant = granted(attempt(&active, &req).await);
    shard.queue_waiter("order-42");
    let seen = inspect(&active, &shard, "order-42").await;
    let Some((token, expires)) = seen.holder else {
        panic!("expected a holder");
    };
    assert_eq!(token, grant.fencing_token);
    assert!(about(expires, u64::from(TTL)));
    assert_eq!(seen.client_id.as_deref(), Some("w1"));
    assert_eq!(seen.metadata, req.metadata);
    let at = seen.acquired_at.expect("when it was granted");
    assert!(at + Duration::from_millis(1) >= asked && at <= SystemTime::now());
    assert_eq!((seen.shard.as_str(), seen.waiters), ("a", 1));
}

#[tokio::test]
async fn inspect_shows_no_holder_of_a_released_or_lost_lock() {
    let (active, shard) = (active(), shard("a"));
    let released = granted(attempt(&active, &acquire(&shard, "order-1", "w1")).await);
    release(&active, &shard, &released).await;
    let lost = granted(attempt(&active, &acquire(&shard, "order-2", "w2")).await);
    shard.expire(lock_id(&active, &lost).lease);
    for name in ["order-1", "order-2"] {
        let seen = inspect(&active, &shard, name).await;
        assert!(seen.holder.is_none() && seen.client_id.is_none(), "{name}");
        assert_eq!((seen.shard.as_str(), seen.waiters), ("a", 0));
    }
}

/// What a force-release of `name` on `shard` does, with `only`.
async fn force(shard: &FakeShard, name: &str, only: Option<u64>) -> Option<ForceOutcome> {
    let k = shard.name_keys(&name_hash(name));
    let lock = shard.read_name(&k).await.expect("a read").lock;
    (active().force_on(shard, &k, lock, only))
        .await
        .unwrap_or_else(|e| panic!("the force-release failed: {e}"))
}

#[tokio::test]
async fn a_forced_name_is_granted_next_under_a_larger_token() {
    let (active, shard) = (active(), shard("a"));
    let first = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let Some(ForceOutcome::Released(forced)) = force(&shard, "order-42", None).await else {
        panic!("expected the lock taken");
    };
    assert_eq!(
        (forced.shard.as_str(), forced.fencing_token),
        ("a", first.fencing_token)
    );
    assert_eq!(forced.client_id, "w1");
    assert!(shard.lock_key("order-42").is_none());
    assert!(matches!(
        renew(&active, &shard, &first).await,
        RenewOutcome::Expired
    ));
    // Taken, not lost: no lock-delay.
    let next = granted(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    assert!(next.fencing_token > first.fencing_token);
    // The former holder's release touches nothing of it.
    release(&active, &shard, &first).await;
    let key = shard.lock_key("order-42").expect("held by w2");
    assert_eq!(key.create_revision(), lock_id(&active, &next).revision);
    assert!(force(&shard, "order-43", None).await.is_none(), "free");
}

#[tokio::test]
async fn a_force_release_naming_another_grants_token_takes_nothing() {
    let (active, shard) = (active(), shard("a"));
    let grant = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let key = shard.lock_key("order-42");
    let other = force(&shard, "order-42", Some(grant.fencing_token + 1)).await;
    assert!(matches!(
        other,
        Some(ForceOutcome::OtherGrant { fencing_token }) if fencing_token == grant.fencing_token
    ));
    assert_eq!(shard.lock_key("order-42"), key);
    let own = force(&shard, "order-42", Some(grant.fencing_token)).await;
    assert!(matches!(own, Some(ForceOutcome::Released(_))));
    assert!(shard.lock_key("order-42").is_none());
}

#[tokio::test]
async fn a_force_release_read_before_its_holder_let_go_spares_the_next_grant() {
    let (active, shard) = (active(), shard("a"));
    let first = granted(attempt(&active, &acquire(&shard, "order-42", "w1")).await);
    let k = shard.name_keys(&name_hash("order-42"));
    let read = shard.read_name(&k).await.expect("a read").lock;
    release(&active, &shard, &first).await;
    let next = granted(attempt(&active, &acquire(&shard, "order-42", "w2")).await);
    let answer = active.force_on(&*shard, &k, read, None).await;
    assert!(matches!(answer, Ok(None)));
    let key = shard.lock_key("order-42").expect("held by w2");
    assert_eq!(key.create_revision(), lock_id(&active, &next).revision);
}

#[tokio::test]
async fn a_force_release_naming_a_token_never_issued_is_invalid() {
    let answer = active().force_release("order-42", Some(0)).await;
    assert!(matches!(answer, Err(LockError::InvalidArgument(_))));
}
