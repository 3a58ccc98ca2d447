//! TLS and etcd auth from the router to etcd, on real etcd clusters whose
//! certificates are made when the test starts them: a router with the
//! cluster's CA and a client certificate serves; one that does not trust
//! the CA, or has no certificate etcd accepts, finds the shard unreachable
//! and answers 503 in bounded time; with etcd auth, the right password
//! works, a wrong one (or none) is refused and logged, and a token that
//! lapsed is replaced without failing a request; settings that cannot
//! work are refused naming the key, at start and at reload, a reload takes
//! up a new client certificate, and a shard a reload removes drains over
//! the TLS this replica's config gave it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lockrouter::ring::Ring;
use lockrouter::Settings;
use lockrouter_testkit::api::{Api, Reply};
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::{EtcdBuilder, EtcdCluster};
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::pki::{self, Ca};
use lockrouter_testkit::router::{FileRouter, TestRouter};
use lockrouter_testkit::router_process::RouterProcess;
use lockrouter_testkit::sleep_ms;

/// How long a shard may take to show a state after a router starts or
/// reloads: a few health intervals (200 ms in the kit's configs) and etcd
/// deadlines (1 s).
const STATE_WITHIN: Duration = Duration::from_secs(15);

/// A cluster of `size` members, built by `build` (TLS, auth), started.
fn cluster(size: usize, build: impl FnOnce(EtcdBuilder) -> EtcdBuilder) -> EtcdCluster {
    build(EtcdCluster::builder(size))
        .start()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Polls `/readyz` until the first shard is in `state`; returns the answer.
async fn wait_shard_state(api: &Api, state: &str) -> Reply {
    let deadline = Instant::now() + STATE_WITHIN;
    loop {
        if let Ok(r) = api.http.get(format!("{}/readyz", api.base)).send().await {
            drop(r);
            let r = api.get("/readyz").await;
            if r.body["shards"][0]["state"] == state {
                return r;
            }
            assert!(Instant::now() < deadline, "shard never {state}: {r:?}");
        }
        assert!(Instant::now() < deadline, "the router never answered");
        sleep_ms(100).await;
    }
}

/// How long a shard the router cannot use must stay `unreachable`: every
/// shard starts so, and one the router can reach is up within a probe or
/// two (200 ms each, each within etcd's 1 s deadline).
const STAYS_FOR: Duration = Duration::from_secs(3);

/// The first shard is `unreachable` at every look for [`STAYS_FOR`], and
/// the router not ready (its only shard does not answer).
async fn assert_stays_unreachable(api: &Api) {
    wait_shard_state(api, "unreachable").await;
    let until = Instant::now() + STAYS_FOR;
    while Instant::now() < until {
        let r = api.get("/readyz").await;
        assert_eq!(r.body["shards"][0]["state"], "unreachable", "{r:?}");
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.body["unreachableShards"][0], "a", "{r:?}");
        sleep_ms(100).await;
    }
}

/// An acquire on the unreachable shard: 503 `shard_unavailable` with
/// `Retry-After`, within the shard's etcd deadline (1 s) and a margin.
async fn assert_unavailable(api: &Api, name: &str) {
    let started = Instant::now();
    let r = api.acquire(name, 5_000, "A").await;
    let took = started.elapsed();
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.body["error"]["code"], "shard_unavailable", "{r:?}");
    assert!(r.retry_after.is_some(), "{r:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    eprintln!("{name}: 503 shard_unavailable in {took:?}");
}

/// Renews, several times across a TTL, then releases; a new holder gets a
/// larger token.
async fn acquire_renew_release(api: &Api, name: &str) {
    let lock = api.must_acquire(name, 2_000, "A").await;
    for _ in 0..3 {
        sleep_ms(800).await;
        let r = api.renew(&lock).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["renewed"], true, "{r:?}");
    }
    assert_eq!(api.inspect(name).await.body["fencingToken"], lock.1);
    assert_eq!(api.release(&lock).await.status, 204);
    let next = api.must_acquire(name, 2_000, "B").await;
    assert!(next.1 > lock.1, "{next:?} after {lock:?}");
}

/// The kit's config for `etcd` with the line that sets `key` replaced
/// by `line` (empty: dropped).
fn with_line(etcd: &EtcdCluster, listen: &str, key: &str, line: &str) -> String {
    let toml = config_toml(&[etcd], listen, "");
    let found = toml
        .lines()
        .filter(|l| l.starts_with(&format!("{key} = ")))
        .count();
    assert_eq!(found, 1, "{key} in {toml}");
    toml.lines()
        .map(|l| {
            if l.starts_with(&format!("{key} = ")) {
                line
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_over_tls_with_a_client_certificate_acquires_renews_and_releases() {
    // Three members: the router's own client per member (probes, hedges,
    // keepalive streams) must speak TLS with the certificate too.
    let etcd = cluster(3, |b| b.client_cert_auth());
    assert!(etcd.endpoints().iter().all(|e| e.starts_with("https://")));
    let router = TestRouter::start(&[&etcd]).await;
    let ready = router.api.get("/readyz").await;
    assert_eq!(ready.body["shards"][0]["state"], "up", "{ready:?}");
    acquire_renew_release(&router.api, "tls:a").await;
}

/// With one member or three: a shard of three is marked down by its
/// member probes, and the log still names why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_does_not_trust_the_shards_ca_cannot_reach_it() {
    for members in [1, 3] {
        let etcd = cluster(members, |b| b.client_cert_auth());
        let dir = tempfile::tempdir().unwrap();
        let stranger = pki::write(dir.path(), "stranger.pem", &Ca::new("stranger").pem);
        let port = free_port();
        let line = format!("tls_ca_file = \"{}\"", stranger.display());
        let toml = with_line(&etcd, &format!("127.0.0.1:{port}"), "tls_ca_file", &line);
        let router = RouterProcess::spawn(&toml, port);
        assert_stays_unreachable(&router.api).await;
        assert_unavailable(&router.api, "untrusted").await;
        assert_eq!(router.api.get("/healthz").await.status, 200);
        let log = router.log_text();
        let down = log.lines().find(|l| l.contains("shard is unavailable"));
        let down = down.unwrap_or_else(|| panic!("{members} members: {log}"));
        assert!(down.contains("UnknownIssuer"), "{members} members: {down}");
        assert!(!log.contains("panicked"), "{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_client_cert_auth_refuses_a_router_without_an_accepted_certificate() {
    let etcd = cluster(1, |b| b.client_cert_auth());
    // No certificate at all.
    let toml = with_line(&etcd, "127.0.0.1:0", "tls_cert_file", "");
    let toml = toml.replace(
        &format!(
            "tls_key_file = \"{}\"",
            etcd.tls().unwrap().client_key_file.display()
        ),
        "",
    );
    let without = TestRouter::spawn(&toml).await;
    assert_stays_unreachable(&without.api).await;
    assert_unavailable(&without.api, "no-cert").await;
    // A certificate another CA signed.
    let dir = tempfile::tempdir().unwrap();
    let other = Ca::new("other").client("intruder");
    let cert = pki::write(dir.path(), "cert.pem", &other.cert_pem);
    let key = pki::write(dir.path(), "key.pem", &other.key_pem);
    let tls = etcd.tls().unwrap();
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
        .replace(
            &tls.client_cert_file.display().to_string(),
            &cert.display().to_string(),
        )
        .replace(
            &tls.client_key_file.display().to_string(),
            &key.display().to_string(),
        );
    let wrong = TestRouter::spawn(&toml).await;
    assert_stays_unreachable(&wrong.api).await;
    assert_unavailable(&wrong.api, "wrong-cert").await;
    // The cluster itself serves a router with its certificate meanwhile.
    let good = TestRouter::start(&[&etcd]).await;
    good.api.must_acquire("cert-ok", 5_000, "A").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_auth_the_right_password_works_and_a_wrong_one_is_refused() {
    let etcd = cluster(3, |b| b.tls().auth());
    let auth = etcd.auth().unwrap();
    // The router's user may use its prefix only.
    let router = TestRouter::start(&[&etcd]).await;
    acquire_renew_release(&router.api, "auth:a").await;

    let dir = tempfile::tempdir().unwrap();
    let wrong = pki::write(dir.path(), "wrong-password", "not-the-password\n");
    let port = free_port();
    let line = format!("password_file = \"{}\"", wrong.display());
    let toml = with_line(&etcd, &format!("127.0.0.1:{port}"), "password_file", &line);
    let refused = RouterProcess::spawn(&toml, port);
    assert_stays_unreachable(&refused.api).await;
    assert_unavailable(&refused.api, "auth:b").await;
    let log = refused.log_text();
    assert!(
        log.contains("etcd refuses this router's user") && log.contains(&auth.user),
        "{log}"
    );
    assert!(log.contains("authentication failed"), "{log}");
    assert!(
        !log.contains("not-the-password"),
        "the log shows the password: {log}"
    );

    // No user at all: etcd asks for one, and the log says which settings.
    let toml = with_line(&etcd, "127.0.0.1:0", "username", "");
    let toml = toml.replace(
        &format!("password_file = \"{}\"", auth.password_file.display()),
        "",
    );
    let anonymous = TestRouter::spawn(&toml).await;
    assert_stays_unreachable(&anonymous.api).await;
    assert_unavailable(&anonymous.api, "auth:c").await;
    // The router with the right password still serves.
    router.api.must_acquire("auth:d", 5_000, "A").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_etcd_token_is_replaced_without_failing_a_request() {
    // Tokens lapse after 2 s unused (etcd checks each second). The
    // router's health probes would use its token every interval: ten
    // minutes between them leave it unused.
    let etcd = cluster(1, |b| b.tls().auth().args(&["--auth-token-ttl", "2"]));
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "")
        .replace("health_interval_ms = 200", "health_interval_ms = 600000");
    let router = TestRouter::with_toml(&toml).await;
    let lock = router.api.must_acquire("lapse:a", 30_000, "A").await;
    let refusals = || etcd.log_text(0).matches("invalid auth token").count();
    assert_eq!(refusals(), 0);
    sleep_ms(4_000).await;
    let started = Instant::now();
    let r = router.api.acquire("lapse:b", 30_000, "B").await;
    let took = started.elapsed();
    assert_eq!(
        r.status, 200,
        "the first call after the token lapsed: {r:?}"
    );
    assert_eq!(r.body["acquired"], true, "{r:?}");
    // etcd refused the lapsed token: the router asked for a new one and
    // sent the request again.
    assert!(refusals() >= 1, "{}", etcd.log_text(0));
    eprintln!("acquire after the token lapsed took {took:?}");
    assert_eq!(router.api.renew(&lock).await.status, 200);
}

/// Runs the binary with `args`, at most 20 s; its exit code and stderr.
fn run_bounded(args: &[&str], config: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
        .args(args)
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lockrouter {args:?} did not stop");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn shard_tls_and_auth_settings_that_cannot_work_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let check = |shard: &str, args: &[&str]| {
        std::fs::write(
            &path,
            format!("[server]\nlisten = \"127.0.0.1:0\"\n\n[[shards]]\nname = \"a\"\n{shard}"),
        )
        .unwrap();
        run_bounded(args, &path)
    };
    let config_check = ["config", "check", "--config"];
    let https = "endpoints = [\"https://127.0.0.1:1\"]\n";
    for (shard, needle) in [
        (https.to_string(), "shards[].tls_ca_file"),
        (
            "endpoints = [\"https://127.0.0.1:1\", \"http://127.0.0.1:2\"]\ntls_ca_file = \"/x\"\n"
                .to_string(),
            "mix http:// and https://",
        ),
        (
            format!("{https}tls_ca_file = \"/x\"\ntls_cert_file = \"/y\"\n"),
            "shards[].tls_cert_file and shards[].tls_key_file",
        ),
        (
            "endpoints = [\"http://127.0.0.1:1\"]\ntls_ca_file = \"/x\"\n".to_string(),
            "shards[].tls_ca_file needs https://",
        ),
        (
            "endpoints = [\"http://127.0.0.1:1\"]\npassword_file = \"/x\"\n".to_string(),
            "shards[].username and shards[].password_file",
        ),
    ] {
        let (code, err) = check(&shard, &config_check);
        assert_eq!(code, Some(2), "{shard}: {err}");
        assert!(err.contains(needle), "{shard}: {err} should name {needle}");
    }
    // Valid settings naming files that do not exist stop `serve`, naming
    // the setting and the file.
    let (code, err) = check(
        &format!("{https}tls_ca_file = \"/nonexistent/etcd-ca.pem\"\n"),
        &["serve", "--config"],
    );
    assert!(code.is_some_and(|c| c != 0), "{err}");
    assert!(
        err.contains("shards[].tls_ca_file") && err.contains("/nonexistent/etcd-ca.pem"),
        "{err}"
    );
    let (code, err) = check(
        "endpoints = [\"http://127.0.0.1:1\"]\nusername = \"u\"\npassword_file = \"/nonexistent/pw\"\n",
        &["serve", "--config"],
    );
    assert!(code.is_some_and(|c| c != 0), "{err}");
    assert!(err.contains("shards[].password_file"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_refuses_a_missing_ca_and_takes_up_a_new_client_certificate() {
    let etcd = cluster(1, |b| b.client_cert_auth());
    let tls = etcd.tls().unwrap();
    let good = config_toml(&[&etcd], "127.0.0.1:0", "");
    let router = FileRouter::start(&good).await;
    let api = &router.api;
    let lock = api.must_acquire("reload:a", 30_000, "A").await;

    let ca = tls.ca_file.display().to_string();
    let r = router
        .reload(&good.replace(&ca, "/nonexistent/etcd-ca.pem"))
        .await;
    assert_eq!(r.status, 400, "{r:?}");
    let msg = r.body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("shards[].tls_ca_file") && msg.contains("/nonexistent/etcd-ca.pem"),
        "{r:?}"
    );
    // Nothing changed: the router serves on.
    api.must_acquire("reload:b", 5_000, "A").await;
    assert_eq!(api.renew(&lock).await.status, 200);

    // A reload to a certificate etcd does not accept is taken up (the
    // files are good): the shard becomes unreachable, which shows the new
    // certificate is the one in use.
    let dir = tempfile::tempdir().unwrap();
    let swap = |leaf: &pki::Leaf, tag: &str| {
        let cert = pki::write(dir.path(), &format!("{tag}.pem"), &leaf.cert_pem);
        let key = pki::write(dir.path(), &format!("{tag}-key.pem"), &leaf.key_pem);
        good.replace(
            &tls.client_cert_file.display().to_string(),
            &cert.display().to_string(),
        )
        .replace(
            &tls.client_key_file.display().to_string(),
            &key.display().to_string(),
        )
    };
    let r = router
        .reload(&swap(&Ca::new("other").client("router"), "foreign"))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_stays_unreachable(api).await;
    assert_unavailable(api, "reload:c").await;

    // A new certificate from the cluster's CA: reachable again, and the
    // lock held all along still renews under its token.
    let r = router
        .reload(&swap(&tls.ca.client("router-rotated"), "rotated"))
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let started = Instant::now();
    wait_shard_state(api, "up").await;
    let r = api.renew(&lock).await;
    assert_eq!(r.status, 200, "{r:?}");
    eprintln!("up again {:?} after the rotating reload", started.elapsed());
    assert_eq!(api.inspect("reload:a").await.body["fencingToken"], lock.1);
}

/// `toml` without its `[[shards]]` table named `name`.
fn without_shard(toml: &str, name: &str) -> String {
    let start = toml
        .find(&format!("\n[[shards]]\nname = \"{name}\"\n"))
        .expect("the shard's table");
    let end = toml[start + 1..]
        .find("\n[[shards]]")
        .map_or(toml.len(), |i| start + 1 + i);
    format!("{}{}", &toml[..start], &toml[end..])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_tls_shard_drains_over_the_tls_of_this_replicas_config() {
    let (ca, cb) = (
        cluster(1, |b| b.client_cert_auth()),
        cluster(1, |b| b.client_cert_auth()),
    );
    let both = config_toml(&[&ca, &cb], "127.0.0.1:0", "count_interval_ms = 200");
    let settings = Settings::from_toml(&both).unwrap();
    let ring = Ring::new(&settings.shards, settings.ring.vnodes);
    let on_a = (0..)
        .map(|i| format!("drain-{i}"))
        .find(|n| ring.shard_name(n) == "a")
        .unwrap();
    let r = FileRouter::start(&both).await;
    let lock = r.api.must_acquire(&on_a, 10_000, "holder").await;
    // The record of the previous ring names no file: this replica reaches
    // the draining shard with the CA and certificate its config gave it.
    let reload = r.reload(&without_shard(&both, "a")).await;
    assert_eq!(reload.status, 200, "{reload:?}");
    crate::rebalance::wait_granting(&r).await;
    let deadline = Instant::now() + STATE_WITHIN;
    while r.ring().await["migration"]["movedLocksHeld"]["a"] != 1 {
        assert!(Instant::now() < deadline, "{}", r.ring().await);
        sleep_ms(50).await;
    }
    // The open migration's record names shard a, and no file.
    let mut etcd = cb.client().await;
    let key = lockrouter::keys::Keys::new("/lockrouter").ring();
    let record = etcd.get(key, None).await.unwrap();
    let text = String::from_utf8_lossy(record.kvs()[0].value()).into_owned();
    assert!(
        text.contains("\"previous\"") && text.contains("\"name\":\"a\""),
        "{text}"
    );
    assert!(!text.contains("tls_") && !text.contains(".pem"), "{text}");
    assert_eq!(r.api.renew(&lock).await.status, 200);
    assert_eq!(r.api.release(&lock).await.status, 204);
    r.wait_migration_closed(STATE_WITHIN).await;
    let again = r.api.must_acquire(&on_a, 5_000, "other").await;
    assert!(again.1 > lock.1, "{again:?} after {lock:?}");
    assert_eq!(r.api.inspect(&on_a).await.body["shard"], "b");
}
