//! The access log (`server.access_log`) of the `lockrouter` binary: off by
//! default, turned on and off by a reload (`POST /admin/v1/reload`, SIGHUP,
//! a changed file) without a restart, one line per request with target
//! `lockrouter::access` naming its route, status, latency and request id
//! (the clientId of an acquire, the principal, the shard), in text and in
//! JSON, and never a lockId or a bearer token.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use lockrouter_testkit::api::{Api, Reply};
use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router_process::RouterProcess;

const ACQUIRE: &str = "/api/v1/locks/acquire";
const RENEW: &str = "/api/v1/locks/renew";
const RELEASE: &str = "/api/v1/locks/release";
const TOKEN: &str = "access-log-token-5e1d9c2b7a";

/// `toml` with `server.access_log` set to `on`.
fn with_access_log(toml: &str, on: bool) -> String {
    let listen = toml
        .lines()
        .find(|l| l.starts_with("listen = "))
        .expect("a listen line");
    let toml = toml.replace("access_log = true\n", "");
    if on {
        toml.replacen(listen, &format!("{listen}\naccess_log = true"), 1)
    } else {
        toml
    }
}

/// Sends `body` to `path` as request `id`.
async fn post(api: &Api, id: &str, path: &str, body: Value) -> Reply {
    let req = api
        .http
        .post(format!("{}{path}", api.base))
        .header("X-Request-Id", id)
        .json(&body);
    api.send(req).await
}

async fn get(api: &Api, id: &str, path: &str) -> Reply {
    let req = api
        .http
        .get(format!("{}{path}", api.base))
        .header("X-Request-Id", id);
    api.send(req).await
}

fn lock_body(lock: &(String, u64)) -> Value {
    json!({"lockId": lock.0, "fencingToken": lock.1})
}

/// Waits until the router's log satisfies `done`; panics with the log.
async fn wait_for_log(router: &RouterProcess, what: &str, done: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = router.log_text();
        if done(&log) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}:\n{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The access lines of a text log.
fn text_access_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains(" lockrouter::access: "))
        .collect()
}

/// The one access line of a text log for request `id`.
fn text_line<'a>(log: &'a str, id: &str) -> &'a str {
    let field = format!("request_id=\"{id}\"");
    let lines: Vec<&str> = text_access_lines(log)
        .into_iter()
        .filter(|l| l.contains(&field))
        .collect();
    assert_eq!(lines.len(), 1, "one access line for {id}:\n{log}");
    lines[0]
}

/// The latency a text line gives, in ms.
fn text_latency(line: &str) -> f64 {
    let (_, rest) = line.split_once("latency_ms=").expect("latency_ms");
    let n = rest.split(' ').next().unwrap();
    n.parse().unwrap_or_else(|e| panic!("latency_ms={n}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_turns_the_access_log_on_and_off_without_a_restart() {
    let etcd = EtcdCluster::single();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // Reloads only when asked (POST, SIGHUP), not on the file's change.
    let off = config_toml(&[&etcd], &listen, "\n[admin]\nreload_poll_ms = 0\n");
    let router = RouterProcess::spawn(&off, port);
    router.api.wait_ready().await;
    let api = &router.api;
    let body = json!({"name": "logged", "ttlMs": 5000, "clientId": "worker-7"});

    // Off by default: requests leave no access line.
    let lock = post(api, "quiet-1", ACQUIRE, body.clone()).await.granted();
    assert_eq!(get(api, "quiet-2", "/healthz").await.status, 200);
    let log = router.log_text();
    assert!(text_access_lines(&log).is_empty(), "{log}");

    // On by POST /admin/v1/reload: the next requests are logged.
    router.rewrite_config(&with_access_log(&off, true)).unwrap();
    let r = api.post("/admin/v1/reload", json!({})).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(router.log_text().contains("access log turned on"));
    let again = post(api, "loud-acquire", ACQUIRE, body.clone()).await;
    assert_eq!(again.granted(), lock, "the holder's re-acquire");
    let r = post(api, "loud-renew", RENEW, lock_body(&lock)).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        get(api, "loud-inspect", "/api/v1/locks/logged")
            .await
            .status,
        200
    );
    let r = post(api, "loud-bad", ACQUIRE, json!({"name": "logged"})).await;
    assert_eq!(r.status, 400, "{r:?}");
    let log = router.log_text();

    let acquire = text_line(&log, "loud-acquire");
    for field in [
        "method=\"POST\"",
        "route=\"acquire\"",
        "status=200",
        "client_id=\"worker-7\"",
        // The request span's fields go with the line.
        "shard=\"a\"",
        "outcome=\"acquired\"",
    ] {
        assert!(acquire.contains(field), "{field} in {acquire}");
    }
    assert!(text_latency(acquire) >= 0.0, "{acquire}");
    assert!(!acquire.contains("lock_name"), "{acquire}");
    // A renewal names its lock by lockId only: no name, no clientId, and
    // never the lockId itself.
    let renew = text_line(&log, "loud-renew");
    assert!(
        renew.contains("route=\"renew\"") && renew.contains("status=200"),
        "{renew}"
    );
    assert!(renew.contains("shard=\"a\""), "{renew}");
    assert!(
        !renew.contains("client_id") && !renew.contains("lock_name"),
        "{renew}"
    );
    assert!(!log.contains(&lock.0), "the lockId is logged:\n{log}");
    let inspect = text_line(&log, "loud-inspect");
    assert!(inspect.contains("route=\"inspect\""), "{inspect}");
    assert!(inspect.contains("lock_name=\"logged\""), "{inspect}");
    assert!(inspect.contains("method=\"GET\""), "{inspect}");
    let bad = text_line(&log, "loud-bad");
    assert!(
        bad.contains("status=400") && bad.contains("route=\"acquire\""),
        "{bad}"
    );
    // The admin call that turned it on came before: not logged.
    assert_eq!(text_access_lines(&log).len(), 4, "{log}");

    // Off again by SIGHUP.
    router.rewrite_config(&off).unwrap();
    let pid = router.pid().to_string();
    let hup = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
    assert!(hup.success());
    wait_for_log(&router, "the access log was not turned off", |log| {
        log.contains("access log turned off")
    })
    .await;
    let r = post(api, "quiet-3", RELEASE, lock_body(&lock)).await;
    assert_eq!(r.status, 204, "{r:?}");
    assert_eq!(get(api, "quiet-4", "/healthz").await.status, 200);
    let log = router.log_text();
    let lines = text_access_lines(&log);
    assert_eq!(lines.len(), 4, "{log}");
    assert!(!lines.iter().any(|l| l.contains("quiet-")), "{log}");
}

/// The principal `pay`, which may lock any name, and the key its lockIds
/// are sealed with.
fn principal_toml() -> String {
    use base64::Engine;
    let hash = hex::encode(Sha256::digest(TOKEN.as_bytes()));
    let secret = base64::engine::general_purpose::STANDARD.encode([3u8; 32]);
    format!(
        "\n[[auth.lock_id_keys]]\nid = \"k1\"\nsecret = \"{secret}\"\n\n\
         [[auth.principals]]\nname = \"pay\"\ntoken_sha256 = [\"{hash}\"]\nname_prefixes = [\"\"]\n"
    )
}

/// The JSON lines of a log, each parsed.
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The one access line of a JSON log for request `id`.
fn json_line(log: &str, id: &str) -> Value {
    let lines: Vec<Value> = json_lines(log)
        .into_iter()
        .filter(|l| l["target"] == "lockrouter::access" && l["fields"]["request_id"] == id)
        .collect();
    assert_eq!(lines.len(), 1, "one access line for {id}:\n{log}");
    lines[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_access_lines_name_the_route_status_principal_and_shard() {
    let etcd = EtcdCluster::single();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    // Reloaded when the file changes.
    let extra = format!("\n[admin]\nreload_poll_ms = 100\n{}", principal_toml());
    let off = config_toml(&[&etcd], &listen, &extra);
    let router = RouterProcess::builder()
        .env("LOCKROUTER_LOG_FORMAT", "json")
        .spawn(&with_access_log(&off, true), port)
        .unwrap_or_else(|e| panic!("{e}"));
    router.api.wait_ready().await;
    let api = router.api.with_bearer(TOKEN);
    let body = json!({"name": "json-logged", "ttlMs": 5000, "clientId": "worker-9"});

    let lock = post(&api, "json-acquire", ACQUIRE, body.clone())
        .await
        .granted();
    let r = post(&api, "json-release", RELEASE, lock_body(&lock)).await;
    assert_eq!(r.status, 204, "{r:?}");
    // Without the token: refused, and logged without a principal.
    let r = post(&router.api, "json-anonymous", ACQUIRE, body.clone()).await;
    assert_eq!(r.status, 401, "{r:?}");
    let log = router.log_text();

    let acquire = json_line(&log, "json-acquire");
    let f = &acquire["fields"];
    assert_eq!(acquire["level"], "INFO", "{acquire}");
    assert_eq!(f["method"], "POST", "{acquire}");
    assert_eq!(f["route"], "acquire", "{acquire}");
    assert_eq!(f["status"], 200, "{acquire}");
    assert!(
        f["latency_ms"].as_f64().is_some_and(|ms| ms >= 0.0),
        "{acquire}"
    );
    assert_eq!(f["client_id"], "worker-9", "{acquire}");
    assert_eq!(f["principal"], "pay", "{acquire}");
    assert_eq!(acquire["span"]["shard"], "a", "{acquire}");
    assert_eq!(acquire["span"]["request_id"], "json-acquire", "{acquire}");

    let release = json_line(&log, "json-release");
    let f = &release["fields"];
    assert_eq!(
        (&f["route"], &f["status"]),
        (&json!("release"), &json!(204)),
        "{release}"
    );
    assert_eq!(f["principal"], "pay", "{release}");
    assert!(f.get("client_id").is_none(), "{release}");
    assert_eq!(release["span"]["shard"], "a", "{release}");

    let anonymous = json_line(&log, "json-anonymous");
    assert_eq!(anonymous["fields"]["status"], 401, "{anonymous}");
    assert!(
        anonymous["fields"].get("principal").is_none(),
        "{anonymous}"
    );
    assert!(!log.contains(TOKEN), "the bearer token is logged:\n{log}");
    assert!(!log.contains(&lock.0), "the lockId is logged:\n{log}");

    // Off again when the file changes.
    router.rewrite_config(&off).unwrap();
    wait_for_log(&router, "the access log was not turned off", |log| {
        log.contains("access log turned off")
    })
    .await;
    let r = post(&api, "json-quiet", ACQUIRE, body).await;
    assert_eq!(r.status, 200, "{r:?}");
    let log = router.log_text();
    let quiet = json_lines(&log)
        .into_iter()
        .any(|l| l["target"] == "lockrouter::access" && l["fields"]["request_id"] == "json-quiet");
    assert!(!quiet, "{log}");
}
