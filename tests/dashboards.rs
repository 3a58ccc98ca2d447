//! The monitoring files in `deploy/` against real processes. Debian's
//! `prometheus`, started on `deploy/prometheus/`'s config and rules, scrapes
//! the router binary and two etcd shards under light load (with principals,
//! one of them at its quota, a sealed-lockId key, waiting acquires and
//! force-releases, so that every series has samples); then every panel
//! query of both Grafana dashboards must return a number, every recording
//! rule must evaluate to one, every alert must evaluate without error, and
//! the shard-down alert must fire once a shard's etcd dies. `promtool` must
//! accept the config and rules and pass the alerts' unit tests
//! (`deploy/prometheus/tests/`), and every YAML and JSON file under
//! `deploy/` must parse. A panel that cannot show data fails here, not on a
//! dashboard.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use lockrouter_testkit::api::Api;
use lockrouter_testkit::config::shard_name;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router_process::RouterProcess;
use lockrouter_testkit::sleep_ms;

const DASHBOARDS: [&str; 2] = ["lockrouter-capacity.json", "lockrouter-operations.json"];

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Debian installs both tools in /usr/bin; `make test` installs them.
fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} is not installed: run `make test`, which installs Debian's prometheus")
        })
}

fn promtool(args: &[&str]) {
    let out = Command::new(tool("promtool"))
        .args(args)
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn promtool_accepts_the_config_and_rules() {
    let config = repo("deploy/prometheus/prometheus.yml");
    // `check config` also checks every rule file the config loads.
    promtool(&["check", "config", config.to_str().unwrap()]);
    let rules: Vec<String> = std::fs::read_dir(repo("deploy/prometheus/rules"))
        .unwrap()
        .map(|e| e.unwrap().path().to_string_lossy().into_owned())
        .collect();
    assert!(rules.len() >= 2, "{rules:?}");
    let mut args = vec!["check", "rules"];
    args.extend(rules.iter().map(String::as_str));
    promtool(&args);
}

#[test]
fn alerts_fire_on_synthetic_series_and_only_then() {
    let tests = repo("deploy/prometheus/tests/alerts.test.yml");
    promtool(&["test", "rules", tests.to_str().unwrap()]);
}

/// Every `.yml`, `.yaml` and `.json` under `dir`.
fn config_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            config_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yml" | "yaml" | "json")
        ) {
            out.push(path);
        }
    }
}

#[test]
fn every_deploy_file_parses() {
    let mut files = Vec::new();
    config_files(&repo("deploy"), &mut files);
    assert!(files.len() >= 20, "{files:?}");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str::<Value>(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        } else {
            let docs = yaml_rust2::YamlLoader::load_from_str(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(!docs.is_empty(), "{} is empty", path.display());
        }
    }
}

#[test]
fn deploy_router_configs_are_valid_and_match_their_etcd_targets() {
    for path in [
        "deploy/compose/router.toml",
        "deploy/k8s/router/router.toml",
    ] {
        let text = std::fs::read_to_string(repo(path)).unwrap();
        let settings = lockrouter::Settings::from_toml(&text)
            .unwrap_or_else(|e| panic!("{path} is refused by the router: {e}"));
        let names: Vec<&str> = settings.shards.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"], "{path}");
    }
    // Prometheus in deploy/compose labels each etcd member with its shard.
    let targets =
        std::fs::read_to_string(repo("deploy/compose/prometheus-targets/etcd.yml")).unwrap();
    let docs = yaml_rust2::YamlLoader::load_from_str(&targets).unwrap();
    let labelled: Vec<&str> = docs[0]
        .as_vec()
        .unwrap()
        .iter()
        .map(|group| group["labels"]["shard"].as_str().unwrap())
        .collect();
    assert_eq!(labelled, ["a", "b", "c"]);
}

fn dashboard(name: &str) -> Value {
    let path = repo(&format!("deploy/grafana/dashboards/{name}"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Panels that show data (rows only group them).
fn data_panels(d: &Value) -> Vec<&Value> {
    let panels = d["panels"].as_array().expect("panels");
    panels.iter().filter(|p| p["type"] != "row").collect()
}

#[test]
fn dashboards_are_well_formed() {
    let mut uids = Vec::new();
    for name in DASHBOARDS {
        let d = dashboard(name);
        uids.push(d["uid"].as_str().expect("uid").to_string());
        assert!(d["schemaVersion"].as_u64().unwrap() >= 36, "{name}");
        let vars: Vec<&str> = d["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        assert_eq!(vars, ["datasource", "shard"], "{name}");
        let mut ids = Vec::new();
        for p in d["panels"].as_array().unwrap() {
            let title = p["title"].as_str().expect("every panel has a title");
            ids.push(p["id"].as_u64().expect("id"));
            let g = &p["gridPos"];
            let (x, w) = (g["x"].as_u64().unwrap(), g["w"].as_u64().unwrap());
            assert!(
                x + w <= 24 && g["h"].as_u64().unwrap() > 0,
                "{name}: {title}"
            );
            if p["type"] == "row" {
                continue;
            }
            assert!(
                ["timeseries", "stat", "bargauge", "gauge"].contains(&p["type"].as_str().unwrap()),
                "{name}: {title}"
            );
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{name}: {title}");
            assert!(
                !p["description"].as_str().unwrap_or("").is_empty(),
                "{title}"
            );
            let targets = p["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{name}: {title} has no query");
            for t in targets {
                assert!(t["expr"].as_str().is_some_and(|e| !e.is_empty()));
                assert!(t["refId"].as_str().is_some());
            }
        }
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n, "{name}: panel ids must be unique");
    }
    assert_ne!(uids[0], uids[1]);
}

/// A Prometheus server on the shipped config and rules, scraping the given
/// targets every second; killed on drop.
struct Prometheus {
    child: Child,
    base: String,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// `etcd` is `(shard, host:port)` of each member.
    fn start(routers: &[String], etcd: &[(String, String)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let shipped = std::fs::read_to_string(repo("deploy/prometheus/prometheus.yml")).unwrap();
        let mut config = shipped.clone();
        // The shipped 15 s would make the test wait minutes for two samples.
        for key in ["scrape_interval", "evaluation_interval"] {
            let line = format!("  {key}: 15s\n");
            assert_eq!(shipped.matches(&line).count(), 1, "{key} in prometheus.yml");
            config = config.replace(&line, &format!("  {key}: 1s\n"));
        }
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        let rules = dir.path().join("rules");
        std::fs::create_dir(&rules).unwrap();
        for e in std::fs::read_dir(repo("deploy/prometheus/rules")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), rules.join(e.file_name())).unwrap();
        }
        let targets = dir.path().join("targets");
        std::fs::create_dir(&targets).unwrap();
        let routers = json!([{ "targets": routers }]);
        let members: Vec<Value> = etcd
            .iter()
            .map(|(shard, addr)| json!({"targets": [addr], "labels": {"shard": shard}}))
            .collect();
        // JSON is YAML: file_sd reads either.
        std::fs::write(targets.join("lockrouter.yml"), routers.to_string()).unwrap();
        std::fs::write(targets.join("etcd.yml"), Value::from(members).to_string()).unwrap();

        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new(tool("prometheus"))
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    async fn wait_ready(&self, http: &reqwest::Client) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(r) = http.get(format!("{}/-/ready", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            sleep_ms(100).await;
        }
        panic!("prometheus did not become ready; its log:\n{}", self.log());
    }

    async fn api(&self, http: &reqwest::Client, path: &str, query: &[(&str, &str)]) -> Value {
        let r = http
            .get(format!("{}/api/v1/{path}", self.base))
            .query(query)
            .send()
            .await
            .expect("prometheus answers");
        let body: Value = r.json().await.expect("prometheus answers JSON");
        assert_eq!(body["status"], "success", "{path} {query:?}: {body}");
        body["data"].clone()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a query result holds at least one finite number.
fn has_number(data: &Value) -> bool {
    let finite = |v: &Value| {
        v[1].as_str()
            .and_then(|s| s.parse::<f64>().ok())
            .is_some_and(f64::is_finite)
    };
    match data["resultType"].as_str() {
        Some("vector") => data["result"]
            .as_array()
            .is_some_and(|r| r.iter().any(|s| finite(&s["value"]))),
        Some("scalar") => finite(&data["result"]),
        _ => false,
    }
}

/// A panel query as Grafana sends it, with its variables filled in.
fn as_grafana_sends(expr: &str) -> String {
    let q = expr
        .replace("$__rate_interval", "1m")
        .replace("$shard", ".*");
    assert!(!q.contains('$'), "unknown dashboard variable in {expr}");
    q
}

const DASH_TOKEN: &str = "dash-token-3c9e1f7a2b6d";
const TIGHT_TOKEN: &str = "tight-token-8d2a6c4e0f1b";
const OPS_TOKEN: &str = "ops-token-5b7d9f1e3a2c";

/// Principals `dash` (the load), `tight` (every name, but one lock at a
/// time: its second is a quota refusal) and the admin `ops`, and a lockId
/// key `k1` sealing every lockId.
fn auth_toml() -> String {
    use base64::Engine;
    use sha2::{Digest, Sha256};
    let hash = |token: &str| hex::encode(Sha256::digest(token.as_bytes()));
    let secret = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
    format!(
        "\n[[auth.lock_id_keys]]\nid = \"k1\"\nsecret = \"{secret}\"\n\n\
         [[auth.principals]]\nname = \"dash\"\ntoken_sha256 = [\"{}\"]\nname_prefixes = [\"\"]\n\n\
         [[auth.principals]]\nname = \"tight\"\ntoken_sha256 = [\"{}\"]\nname_prefixes = [\"\"]\n\
         max_held_locks = 1\n\n\
         [[auth.principals]]\nname = \"ops\"\ntoken_sha256 = [\"{}\"]\nadmin = true\n",
        hash(DASH_TOKEN),
        hash(TIGHT_TOKEN),
        hash(OPS_TOKEN)
    )
}

/// The router as each principal of [`auth_toml`].
#[derive(Clone)]
struct Callers {
    dash: Api,
    tight: Api,
    ops: Api,
}

impl Callers {
    fn of(api: &Api) -> Self {
        Self {
            dash: api.with_bearer(DASH_TOKEN),
            tight: api.with_bearer(TIGHT_TOKEN),
            ops: api.with_bearer(OPS_TOKEN),
        }
    }
}

/// Acquires, renews (one by one and in batches), inspects and releases a
/// few dozen names, and sends a bad request now and then, until `stop`.
/// Most acquires find their name held by another worker, so they are
/// answered by a read first; the renewals go through the lock-key cache,
/// and grants and releases through group commits. Now and then `ops`
/// force-releases a held name, and `tight` asks for a second lock while it
/// holds its one (refused at its quota).
async fn light_load(callers: Callers, stop: Arc<AtomicBool>) {
    let api = callers.dash;
    let mut held: BTreeMap<String, (String, u64)> = BTreeMap::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let name = format!("dash-{}", i % 40);
        // 3 does not divide 40: each name comes round to each worker in
        // turn, so a held name is asked for by another client.
        let client = format!("worker-{}", i % 3);
        let r = api.acquire(&name, 10_000, &client).await;
        if r.body["acquired"] == true {
            let lock = (
                r.body["lockId"].as_str().unwrap().to_string(),
                r.body["fencingToken"].as_u64().unwrap(),
            );
            held.insert(name.clone(), lock);
        }
        if let Some(lock) = held.values().next() {
            api.renew(lock).await;
        }
        if i % 5 == 0 && !held.is_empty() {
            let locks: Vec<Value> = held
                .values()
                .map(|(id, token)| json!({"lockId": id, "fencingToken": token}))
                .collect();
            api.post("/api/v1/locks/renew-batch", json!({ "locks": locks }))
                .await;
        }
        if held.len() > 25 {
            let oldest = held.keys().next().cloned().unwrap();
            let lock = held.remove(&oldest).unwrap();
            api.release(&lock).await;
        }
        api.inspect(&name).await;
        if i % 10 == 0 {
            api.acquire(&name, 1, &client).await; // 400 invalid_argument
        }
        if i % 4 == 0 {
            // The first is granted (or is tight's own lock already); the
            // second finds tight at its max_held_locks.
            callers.tight.acquire("tight-0", 10_000, "t").await;
            callers.tight.acquire("tight-1", 10_000, "t").await;
        }
        if i % 15 == 7 {
            if let Some(taken) = held.keys().next_back().cloned() {
                let path = format!("/admin/v1/locks/{taken}/force-release");
                let reason = json!({"reason": "dashboard test"});
                callers.ops.post(&path, reason).await;
                held.remove(&taken);
            }
        }
        i += 1;
        // Light on purpose: the suite runs other timing-sensitive tests
        // beside this one on few cores.
        sleep_ms(150).await;
    }
}

/// Waiting acquires, until `stop`: a holder takes a name, a waiter queues
/// for it and gets it when the holder releases (or, every third round, gives
/// up first), then releases it too: waiters, waits of both outcomes and
/// hold times of a fraction of a second.
async fn waiting_load(api: Api, stop: Arc<AtomicBool>) {
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let name = format!("dash-wait-{}", round % 4);
        let r = api.acquire(&name, 10_000, "holder").await;
        if r.body["acquired"] != true {
            round += 1;
            sleep_ms(200).await;
            continue;
        }
        let holder = (
            r.body["lockId"].as_str().unwrap().to_string(),
            r.body["fencingToken"].as_u64().unwrap(),
        );
        let gives_up = round % 3 == 2;
        let wait_ms = if gives_up { 150 } else { 5_000 };
        let waiter = {
            let (api, name) = (api.clone(), name.clone());
            tokio::spawn(async move {
                let body =
                    json!({"name": name, "ttlMs": 10_000, "clientId": "waiter", "waitMs": wait_ms});
                api.post("/api/v1/locks/acquire", body).await
            })
        };
        sleep_ms(300).await;
        api.release(&holder).await;
        // Not asserted: the test ends by killing a shard under this load.
        let r = waiter.await.unwrap();
        if r.body["acquired"] == true {
            sleep_ms(100).await;
            let lock = (
                r.body["lockId"].as_str().unwrap().to_string(),
                r.body["fencingToken"].as_u64().unwrap(),
            );
            api.release(&lock).await;
        }
        round += 1;
        sleep_ms(200).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_rule_shows_data_from_a_live_router() {
    let mut shards = [EtcdCluster::single(), EtcdCluster::single()];
    let router =
        RouterProcess::start_with(&[&shards[0], &shards[1]], free_port(), &auth_toml()).await;
    let members: Vec<(String, String)> = shards
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            s.endpoints()
                .into_iter()
                .map(move |e| (shard_name(i), e.trim_start_matches("http://").to_string()))
        })
        .collect();
    let router_target = router.api.base.trim_start_matches("http://").to_string();
    let prom = Prometheus::start(&[router_target], &members);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    prom.wait_ready(&http).await;

    let stop = Arc::new(AtomicBool::new(false));
    let callers = Callers::of(&router.api);
    let waits = tokio::spawn(waiting_load(callers.dash.clone(), stop.clone()));
    let load = tokio::spawn(light_load(callers, stop.clone()));

    // Everything that must show a number: each panel query, each recorded
    // series. Retried until each does: counters need two scrapes, the lock
    // count is sampled every 10 s, rules run after scrapes.
    let mut pending: HashMap<String, String> = HashMap::new();
    for name in DASHBOARDS {
        let d = dashboard(name);
        for p in data_panels(&d) {
            for t in p["targets"].as_array().unwrap() {
                let what = format!("{name} / {}", p["title"].as_str().unwrap());
                pending.insert(as_grafana_sends(t["expr"].as_str().unwrap()), what);
            }
        }
    }
    // Panels that show 0 when their series is missing must see the
    // series itself too: the load makes each of them.
    for series in [
        "lockrouter_force_releases_total",
        "lockrouter_quota_refusals_total{principal=\"tight\", quota=\"max_held_locks\"}",
        "lockrouter_wait_seconds_count{outcome=\"not_acquired\"}",
        "lockrouter_lock_ids_opened_total{key=\"k1\"}",
    ] {
        let q = format!("sum({series}) > 0");
        pending.insert(q, format!("the load's {series}"));
    }
    let groups = prom.api(&http, "rules", &[]).await;
    let mut alerts = Vec::new();
    for g in groups["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            let name = r["name"].as_str().unwrap().to_string();
            match r["type"].as_str() {
                Some("recording") => {
                    pending.insert(name.clone(), format!("recording rule {name}"));
                }
                _ => alerts.push(name),
            }
        }
    }
    assert!(pending.len() > 60, "{} queries", pending.len());
    assert!(alerts.len() >= 10, "{alerts:?}");

    let deadline = Instant::now() + Duration::from_secs(150);
    let mut last = HashMap::new();
    while !pending.is_empty() && Instant::now() < deadline {
        let queries: Vec<String> = pending.keys().cloned().collect();
        for q in queries {
            let data = prom.api(&http, "query", &[("query", &q)]).await;
            if has_number(&data) {
                pending.remove(&q);
            } else {
                last.insert(q, data);
            }
        }
        sleep_ms(2_000).await;
    }
    let missing: Vec<String> = pending
        .iter()
        .map(|(q, what)| format!("{what}\n    {q}\n    last answer: {}", last[q]))
        .collect();
    assert!(missing.is_empty(), "no data for:\n{}", missing.join("\n"));

    // Every rule, alerts included, evaluated without error.
    let groups = prom.api(&http, "rules", &[]).await;
    for g in groups["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "rule {}: {}", r["name"], r["lastError"]);
        }
    }
    // The dashboards' shard variable lists the shards.
    let shard_values = prom
        .api(
            &http,
            "label/shard/values",
            &[("match[]", "lockrouter_shard_up")],
        )
        .await;
    assert_eq!(shard_values, json!(["a", "b"]));

    // A dead shard raises the shard-down alert (pending during its `for`).
    shards[1].kill();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let data = prom.api(&http, "alerts", &[]).await;
        let down = data["alerts"].as_array().unwrap().iter().any(|a| {
            a["labels"]["alertname"] == "LockrouterShardDown" && a["labels"]["shard"] == "b"
        });
        if down {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "LockrouterShardDown did not fire for shard b: {data}"
        );
        sleep_ms(500).await;
    }
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    waits.await.unwrap();
}
