//! A release whose answer never came may still take effect later, and an
//! idempotent re-acquire returns the very grant it names: the interleaving
//! behind two holders at once under mixed faults (docs/design.md, "A
//! release that was not answered"). A router's release txn is held on its
//! way to etcd (a silent link, as a paused member or router would hold
//! it); the client re-acquires the name through another replica, then the
//! held release lands.

use std::time::Duration;

use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::proxy::SilentProxy;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

/// Two replicas on one shard: `direct`, and `held`, whose link to etcd
/// can be silenced, holding what it sends until it speaks again.
async fn replicas(etcd: &EtcdCluster) -> (TestRouter, TestRouter, SilentProxy) {
    let proxy = SilentProxy::start(&etcd.endpoints()[0]).await;
    let direct = TestRouter::start(&[etcd]).await;
    let toml = config_toml(&[etcd], "127.0.0.1:0", "").replace(&etcd.endpoints()[0], &proxy.url());
    let held = TestRouter::with_toml(&toml).await;
    (direct, held, proxy)
}

/// The release is held past its deadline (the client gets 5xx), so its
/// outcome is unknown; the client retries it until it is answered (as the
/// SDKs do) before acquiring the name again. The re-acquire is then a new
/// grant, which the held release, landing late, cannot touch: it names
/// the old grant's create revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_answered_before_the_next_acquire_never_ends_a_later_grant() {
    let etcd = EtcdCluster::single();
    let (direct, held, proxy) = replicas(&etcd).await;
    let first = direct.api.must_acquire("late", 10_000, "X").await;
    proxy.set_silent(true);
    let unanswered = held.api.release(&first).await;
    assert!(unanswered.status >= 500, "{unanswered:?}");
    // The rule: retry the release until it is answered.
    assert_eq!(direct.api.release(&first).await.status, 204);
    let second = direct.api.must_acquire("late", 10_000, "X").await;
    assert!(second.1 > first.1, "a new grant after the release");
    proxy.set_silent(false);
    sleep_ms(1_500).await;
    let other = direct.api.acquire("late", 10_000, "C").await;
    assert_eq!(other.body["acquired"], false, "{other:?}");
    assert_eq!(direct.api.renew(&second).await.status, 200);
}

/// Without the rule: the client re-acquires while its release is still
/// unanswered, gets the same grant back (the contract's idempotent
/// re-acquire), and the held release ends it when it lands, so another
/// client is granted the name while the first still believes it holds it.
/// This is what the rule in docs/client.md prevents; the test keeps the
/// caveat honest (if etcd ever stopped applying a late request, the docs
/// would need to say so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_ends_the_grant_a_re_acquire_returned() {
    let etcd = EtcdCluster::single();
    let (direct, held, proxy) = replicas(&etcd).await;
    let first = direct.api.must_acquire("late", 10_000, "X").await;
    proxy.set_silent(true);
    let unanswered = held.api.release(&first).await;
    assert!(unanswered.status >= 500, "{unanswered:?}");
    let again = direct.api.must_acquire("late", 10_000, "X").await;
    assert_eq!(again, first, "the same grant back");
    proxy.set_silent(false);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let r = direct.api.acquire("late", 10_000, "C").await;
        if r.body["acquired"] == true {
            assert!(r.granted().1 > first.1);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the held release never landed: {r:?}"
        );
        sleep_ms(100).await;
    }
    assert_eq!(direct.api.renew(&first).await.status, 409);
}
