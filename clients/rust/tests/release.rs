//! Releases against a scripted router: retried until the router confirms,
//! not retried when refused, bounded when the client goes away; re-entrant
//! holds of one grant that share one state and one renewal, released once
//! with the last hold; no acquire of a name while the client's release of
//! it is unanswered; no retry sooner than the router's `Retry-After`; and
//! `with_lock` returning its work's own result when the release at its end
//! fails.

mod fake_router;

use std::time::Duration;

use futures::FutureExt;
use lockrouter_client::{AcquireOptions, Client, Error, LostReason};

use fake_router::FakeRouter;

const TTL: Duration = Duration::from_secs(3);

/// Waits (up to 10 s) until the fake has seen `n` requests on `op`.
async fn until_seen(router: &FakeRouter, op: &str, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while router.seen(op).len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "saw {} {op} requests, expected {n}",
            router.seen(op).len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn release_is_retried_until_the_router_confirms() {
    let router = FakeRouter::start().await;
    let client = Client::new(&router.base, None).unwrap();
    let lock = client.acquire("r", TTL).await.unwrap().unwrap();
    router.script_releases(&[503, 503, 204]);
    let done = tokio::time::timeout(Duration::from_secs(5), lock.release()).await;
    assert_eq!(done, Ok(Ok(())), "Ok only after the 204");
    assert_eq!(router.seen("release").len(), 3);
}

#[tokio::test]
async fn a_dropped_lock_is_released_in_the_background_despite_failures() {
    let router = FakeRouter::start().await;
    let client = Client::new(&router.base, None).unwrap();
    let lock = client.acquire("d", TTL).await.unwrap().unwrap();
    router.script_releases(&[503, 503, 503, 204]);
    drop(lock);
    until_seen(&router, "release", 4).await;
    // The 204 ends it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(router.seen("release").len(), 4);
}

#[tokio::test]
async fn a_release_refused_as_malformed_is_not_retried() {
    let router = FakeRouter::start().await;
    let client = Client::new(&router.base, None).unwrap();
    let lock = client.acquire("m", TTL).await.unwrap().unwrap();
    router.script_releases(&[400]);
    let done = tokio::time::timeout(Duration::from_secs(5), lock.release())
        .await
        .unwrap();
    assert!(
        matches!(done, Err(Error::Router { status: 400, .. })),
        "{done:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(router.seen("release").len(), 1);
}

#[tokio::test]
async fn re_entrant_holds_share_one_state_one_renewal_and_one_release_with_the_last() {
    let router = FakeRouter::start().await;
    let client = Client::new(&router.base, None).unwrap();
    let first = client.acquire("twice", TTL).await.unwrap().unwrap();
    let again = AcquireOptions::new(TTL).reentrant();
    let second = client.acquire_with("twice", again).await.unwrap().unwrap();
    assert_eq!(first.lock_id(), second.lock_id());
    assert_eq!(router.seen("acquire").len(), 1, "joined without a request");

    // A renewal interval (a third of the TTL) and a half: renewed, once.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let batches = router.seen("renew-batch");
    assert!(!batches.is_empty(), "renewed within an interval");
    for b in &batches {
        let locks = b.body["locks"].as_array().unwrap();
        assert_eq!(locks.len(), 1, "one grant, renewed once: {}", b.body);
    }
    assert!(first.is_held() && second.is_held());

    let lost = second.lost();
    drop(first);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(second.is_held(), "the other hold keeps the grant");
    assert!(router.seen("release").is_empty());
    assert_eq!(second.release().await, Ok(()));
    assert_eq!(lost.now_or_never(), Some(LostReason::Released));
    assert_eq!(
        router.seen("release").len(),
        1,
        "released once, by the last"
    );
}

#[tokio::test]
async fn dropping_the_last_handle_stops_retrying_within_the_request_timeout() {
    let router = FakeRouter::start().await;
    let client = Client::builder(&router.base)
        .request_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let lock = client
        .acquire("gone", Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    router.fail_releases();
    drop(lock);
    drop(client);
    // Retried while the client's task winds down, then no more: the lock's
    // long validity does not keep a dead client's task alive.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let tried = router.seen("release").len();
    assert!(tried >= 2, "retried before giving up: {tried}");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(router.seen("release").len(), tried, "still retrying");
}

/// The rule of docs/client.md, "A release that was not answered": while
/// this client's release of a name's grant is unanswered, no acquire of
/// that name is sent (the router would answer it with the same grant, which
/// the release, landing late, could then end). The acquire drives the
/// release to an answer first, and fails, retryably, if it cannot.
#[tokio::test]
async fn no_acquire_of_a_name_is_sent_while_its_release_is_unanswered() {
    let router = FakeRouter::start().await;
    let client = Client::builder(&router.base)
        .request_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let lock = client.acquire("r", TTL).await.unwrap().unwrap();
    let old_token = lock.fencing_token();
    router.fail_releases();
    drop(lock); // released in the background, unanswered for now
    until_seen(&router, "release", 1).await;
    let refused = client.acquire("r", TTL).await;
    assert!(
        matches!(&refused, Err(e @ Error::Transport(_)) if e.is_retryable()),
        "{refused:?}"
    );
    assert_eq!(router.seen("acquire").len(), 1, "{:?}", router.ops());
    router.heal_releases();
    let again = client.acquire("r", TTL).await.unwrap().unwrap();
    assert!(again.fencing_token() > old_token, "a new grant");
    let ops = router.ops();
    let tail: Vec<&str> = ops.iter().rev().take(2).rev().map(String::as_str).collect();
    assert_eq!(
        tail,
        ["release", "acquire"],
        "answered, then acquired: {ops:?}"
    );
    assert_eq!(router.seen("acquire").len(), 2, "{ops:?}");
}

/// The gaps between the release requests the fake has seen.
fn release_gaps(router: &FakeRouter) -> Vec<Duration> {
    let seen = router.seen("release");
    seen.windows(2).map(|w| w[1].at - w[0].at).collect()
}

#[tokio::test]
async fn a_release_is_not_retried_before_the_routers_retry_after() {
    let router = FakeRouter::start().await;
    let client = Client::new(&router.base, None).unwrap();
    let lock = client.acquire("later", TTL).await.unwrap().unwrap();
    router.retry_after_on_errors("1");
    router.script_releases(&[503, 204]);
    let done = tokio::time::timeout(Duration::from_secs(5), lock.release()).await;
    assert_eq!(done, Ok(Ok(())));
    let gaps = release_gaps(&router);
    assert_eq!(gaps.len(), 1);
    assert!(gaps[0] >= Duration::from_secs(1), "{gaps:?}");
}

/// A `Retry-After` longer than the lock's validity (2.7 s of a 3 s TTL):
/// `release` cannot keep its deadline, so it answers with the router's
/// refusal at once, and the background task sends the next attempt no
/// sooner than the router asked.
#[tokio::test]
async fn a_retry_after_past_validity_is_left_to_the_background_which_waits_it_out() {
    let router = FakeRouter::start().await;
    let client = Client::new(&router.base, None).unwrap();
    let lock = client.acquire("much-later", TTL).await.unwrap().unwrap();
    router.retry_after_on_errors("3");
    router.script_releases(&[503, 204]);
    let done = tokio::time::timeout(Duration::from_secs(5), lock.release())
        .await
        .unwrap();
    assert!(
        matches!(&done, Err(e @ Error::Router { status: 503, .. }) if e.is_retryable()),
        "{done:?}"
    );
    assert_eq!(
        done.unwrap_err().retry_after(),
        Some(Duration::from_secs(3))
    );
    assert_eq!(router.seen("release").len(), 1, "no attempt fitted");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(router.seen("release").len(), 1, "not yet");
    until_seen(&router, "release", 2).await;
    let gaps = release_gaps(&router);
    assert!(gaps[0] >= Duration::from_secs(3), "{gaps:?}");
}

/// The work's own error, which `with_lock` must hand back as it is.
#[derive(Debug, Clone, PartialEq)]
struct WorkFailed(&'static str);

/// One `with_lock` call: what it returned, how long it took (acquire,
/// work and release), and the grant the work ran under.
struct Ran {
    result: Result<Result<u64, WorkFailed>, Error>,
    took: Duration,
    lock_id: String,
    token: u64,
}

/// `with_lock` on `name` with work that returns `out` at once.
async fn with_lock_returning(client: &Client, name: &str, out: Result<u64, WorkFailed>) -> Ran {
    let start = tokio::time::Instant::now();
    let mut grant = None;
    let result = client
        .with_lock(name, TTL, |lock| {
            grant = Some((lock.lock_id(), lock.fencing_token()));
            async move { out }
        })
        .await;
    let (lock_id, token) = grant.unwrap_or_else(|| panic!("{name} not acquired: {result:?}"));
    Ran {
        result,
        took: start.elapsed(),
        lock_id,
        token,
    }
}

/// Release requests the fake has seen for the grant `lock_id`.
fn releases_of(router: &FakeRouter, lock_id: &str) -> usize {
    let seen = router.seen("release");
    seen.iter().filter(|s| s.body["lockId"] == lock_id).count()
}

/// The request timeout of the `with_lock` tests, and a lock's validity
/// under [`TTL`]: the TTL less its default margin, a tenth.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(400);
const VALIDITY: Duration = Duration::from_millis(2_700);

/// docs/client.md section 7, "a block's exception is never replaced by a
/// failing release at its exit": a release the router refuses (4xx) after
/// the work is logged, and `with_lock` returns the work's `Ok`, or its own
/// `Err`, at once; the refusal is not retried, here or in the background.
#[tokio::test]
async fn with_lock_returns_the_works_own_result_when_the_router_refuses_the_release() {
    let router = FakeRouter::start().await;
    let client = Client::builder(&router.base)
        .request_timeout(REQUEST_TIMEOUT)
        .build()
        .unwrap();
    router.script_releases(&[400, 400]);
    let (ok, err) = tokio::join!(
        with_lock_returning(&client, "refused-ok", Ok(42)),
        with_lock_returning(&client, "refused-err", Err(WorkFailed("disk full"))),
    );
    assert_eq!(ok.result, Ok(Ok(42)), "the work's result, not the refusal");
    assert_eq!(
        err.result,
        Ok(Err(WorkFailed("disk full"))),
        "the work's own error, not the refusal"
    );
    for ran in [&ok, &err] {
        assert!(ran.took < Duration::from_secs(1), "at once: {:?}", ran.took);
        assert_eq!(releases_of(&router, &ran.lock_id), 1);
    }
    // Past a renewal interval, when a background retry would have come.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(router.seen("release").len(), 2, "{:?}", router.ops());
}

/// The same rule when the release cannot get through: `with_lock` retries
/// it while the lock's validity lasts (each attempt bounded by the request
/// timeout), then returns the work's result, `Ok` or its own `Err`, and
/// hands the release to the background, which carries on until the router
/// confirms it: the name is then free, and acquired anew as a new grant.
/// `fail` makes every release fail until the router heals.
async fn with_lock_returns_the_works_own_result_when_the_release_cannot_get_through(
    fail: fn(&FakeRouter),
) {
    let router = FakeRouter::start().await;
    let client = Client::builder(&router.base)
        .request_timeout(REQUEST_TIMEOUT)
        .build()
        .unwrap();
    fail(&router);
    let (ok, err) = tokio::join!(
        with_lock_returning(&client, "unreleased-ok", Ok(42)),
        with_lock_returning(&client, "unreleased-err", Err(WorkFailed("disk full"))),
    );
    assert_eq!(
        ok.result,
        Ok(Ok(42)),
        "the work's result, not the release's error"
    );
    assert_eq!(
        err.result,
        Ok(Err(WorkFailed("disk full"))),
        "the work's own error, not the release's"
    );
    let bound = VALIDITY + REQUEST_TIMEOUT + Duration::from_millis(500);
    for ran in [&ok, &err] {
        assert!(ran.took <= bound, "no longer than validity: {:?}", ran.took);
        assert!(
            releases_of(&router, &ran.lock_id) >= 2,
            "retried within validity: {:?}",
            router.ops()
        );
    }

    // Handed to the background, which keeps trying.
    let before = [ok.lock_id.as_str(), err.lock_id.as_str()].map(|id| releases_of(&router, id));
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    for (ran, before) in [&ok, &err].into_iter().zip(before) {
        let now = releases_of(&router, &ran.lock_id);
        assert!(
            now > before,
            "retried in the background: {now} after {before}"
        );
    }

    // Once the router answers, the next attempt frees the name, unprompted,
    // and the attempts stop.
    router.heal_releases();
    let healed = [ok.lock_id.as_str(), err.lock_id.as_str()].map(|id| releases_of(&router, id));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    for (ran, healed) in [&ok, &err].into_iter().zip(healed) {
        while releases_of(&router, &ran.lock_id) == healed {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no release after healing"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let done = router.seen("release").len();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        router.seen("release").len(),
        done,
        "no attempt after the 204"
    );
    for (name, ran) in [("unreleased-ok", &ok), ("unreleased-err", &err)] {
        let again = client.acquire(name, TTL).await.unwrap().unwrap();
        assert!(again.fencing_token() > ran.token, "a new grant of {name}");
    }
}

#[tokio::test]
async fn with_lock_returns_the_works_own_result_when_the_router_keeps_failing_the_release() {
    with_lock_returns_the_works_own_result_when_the_release_cannot_get_through(
        FakeRouter::fail_releases,
    )
    .await;
}

#[tokio::test]
async fn with_lock_returns_the_works_own_result_when_the_release_goes_unanswered() {
    with_lock_returns_the_works_own_result_when_the_release_cannot_get_through(
        FakeRouter::black_hole_releases,
    )
    .await;
}
