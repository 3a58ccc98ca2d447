//! The `lockrouter` binary: restarts lose no lock, SIGTERM drains and exits
//! 0, and bad configs exit non-zero naming the problem.

use std::process::Command;
use std::time::{Duration, Instant};

use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router_process::RouterProcess;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_router_loses_no_lock_and_replicas_share_locks() {
    let shards = [EtcdCluster::single(), EtcdCluster::single()];
    let port = free_port();
    let mut first = RouterProcess::start(&[&shards[0], &shards[1]], port).await;
    let mut locks = Vec::new();
    for i in 0..10 {
        locks.push(
            first
                .api
                .must_acquire(&format!("survive-{i}"), 10_000, "A")
                .await,
        );
    }
    let replica = RouterProcess::start(&[&shards[0], &shards[1]], free_port()).await;
    first.child.kill().unwrap(); // SIGKILL
    first.child.wait().unwrap();
    let restarted = RouterProcess::start(&[&shards[0], &shards[1]], port).await;
    for (i, lock) in locks.iter().enumerate() {
        let api = if i % 2 == 0 {
            &restarted.api
        } else {
            &replica.api
        };
        assert_eq!(api.renew(lock).await.status, 200);
        assert_eq!(
            api.acquire(&format!("survive-{i}"), 10_000, "B").await.body["acquired"],
            false
        );
    }
    for lock in &locks {
        assert_eq!(replica.api.release(lock).await.status, 204);
    }
    for i in 0..10 {
        restarted
            .api
            .must_acquire(&format!("survive-{i}"), 10_000, "B")
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_zero() {
    let etcd = EtcdCluster::single();
    let mut router = RouterProcess::start(&[&etcd], free_port()).await;
    router.api.must_acquire("t", 5_000, "A").await;
    assert!(router.log_text().contains("lockrouter ready"));
    // The router names the etcd release of each shard, and warns about
    // releases with the stale-leader lease revocation bug.
    let (_, first) = lockrouter_testkit::etcd::etcd_release().unwrap_or_else(|e| panic!("{e}"));
    let version = first.rsplit(' ').next().unwrap();
    let expected = match lockrouter::release_risk(version) {
        Some(_) => "upgrade",
        None => "etcd version",
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !(router.log_text().contains(expected) && router.log_text().contains(version)) {
        assert!(
            Instant::now() < deadline,
            "{expected} {version}:\n{}",
            router.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = sigterm_and_wait(&mut router.child);
    assert!(status.success(), "{status:?}\n{}", router.log_text());
}

/// Sends SIGTERM to `child` and waits up to 15 s for it to exit; kills it
/// and panics if it does not.
fn sigterm_and_wait(child: &mut std::process::Child) -> std::process::ExitStatus {
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the router did not exit on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A router whose stderr is a pipe nobody reads any more (its log shipper
/// died) still drains and exits on SIGTERM: log lines it cannot write are
/// dropped, and nothing it logs can stop the shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_a_router_whose_log_pipe_broke() {
    let etcd = EtcdCluster::single();
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("router.toml");
    let toml = lockrouter_testkit::config::config_toml(&[&etcd], &format!("127.0.0.1:{port}"), "");
    std::fs::write(&path, toml).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let api = lockrouter_testkit::api::Api::new(format!("127.0.0.1:{port}").parse().unwrap());
    api.wait_ready().await;
    drop(child.stderr.take()); // the reading end goes: writes now fail
    api.must_acquire("broken-pipe", 5_000, "A").await;
    let status = sigterm_and_wait(&mut child);
    assert!(status.success(), "{status:?}");
}

#[test]
fn bad_configs_exit_nonzero_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let good_shard = "[[shards]]\nname = \"a\"\nendpoints = [\"http://127.0.0.1:2379\"]\n";
    let cases = [
        (format!("[server]\nlisten = \"127.0.0.1:0\"\nlistne = 1\n{good_shard}"), "listne"),
        ("[server]\nlisten = \"127.0.0.1:0\"\n".to_string(), "no shards"),
        (format!("[server]\nlisten = \"127.0.0.1:0\"\n{good_shard}{good_shard}"), "duplicate shard name"),
        (format!("[server]\nlisten = \"localhost\"\n{good_shard}"), "server.listen"),
        (format!("[server]\nlisten = \"127.0.0.1:0\"\nworker_threads = 5000\n{good_shard}"), "server.worker_threads"),
        ("[server]\nlisten = \"127.0.0.1:0\"\n[[shards]]\nname = \"a\"\nendpoints = [\"nope\"]\n".into(), "endpoint"),
        ("[server]\nlisten = \"127.0.0.1:0\"\n[[shards]]\nname = \"a\"\nendpoints = []\n".into(), "no endpoints"),
        ("[server\nlisten".into(), "cannot read config"),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("bad-{i}.toml"));
        std::fs::write(&path, text).unwrap();
        // `config check` refuses exactly what `serve` refuses.
        for command in [&["serve"][..], &["config", "check"]] {
            let out = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
                .args(command)
                .arg("--config")
                .arg(&path)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(2),
                "case {i} ({command:?}) should exit 2"
            );
            assert!(
                stderr.contains(needle),
                "case {i} ({command:?}): {stderr:?} should mention {needle:?}"
            );
        }
    }
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        format!("[server]\nlisten = \"127.0.0.1:0\"\n{good_shard}"),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
        .args(["config", "check", "--config"])
        .arg(&good)
        .env("LOCKROUTER__ADMIN__TOKEN", "a-secret-of-sixteen-chars")
        .env("LOCKROUTER__SERVER__MAX_IN_FLIGHT", "77")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("valid; shards: a; ring "), "{stderr}");
    // On stdout, the effective settings: defaults and overrides applied,
    // the admin token masked.
    let effective: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(effective["server"]["max_in_flight"], 77, "{effective}");
    assert_eq!(effective["etcd"]["request_timeout_ms"], 3000, "{effective}");
    assert_eq!(effective["admin"]["token"], "***", "{effective}");
    assert!(!stdout.contains("a-secret-of-sixteen-chars"), "{stdout}");
    let out = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
        .args(["serve", "--config", "/nonexistent/lockrouter.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    // An environment override is validated like the file.
    let path = dir.path().join("env.toml");
    std::fs::write(
        &path,
        format!("[server]\nlisten = \"127.0.0.1:0\"\n{good_shard}"),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("LOCKROUTER__LIMITS__MIN_TTL_MS", "10")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("min_ttl_ms"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config_and_bad_reloads_change_nothing() {
    let etcd = EtcdCluster::single();
    let no_poll = "\n[admin]\nreload_poll_ms = 0\n";
    let router = RouterProcess::start_with(&[&etcd], free_port(), no_poll).await;
    let lock = router.api.must_acquire("h", 5_000, "A").await;
    // Renews `lock` three times in one batch.
    let renew_three = || {
        let item = serde_json::json!({"lockId": lock.0, "fencingToken": lock.1});
        let body = serde_json::json!({ "locks": vec![item; 3] });
        router.api.post("/api/v1/locks/renew-batch", body)
    };
    assert_eq!(renew_three().await.status, 200);
    let text = std::fs::read_to_string(&router.config).unwrap();
    let hup = || {
        let pid = router.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success());
    };
    // A broken file is refused and the router goes on as it was.
    std::fs::write(&router.config, "[server\n").unwrap();
    hup();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(renew_three().await.status, 200);
    assert!(
        router.log_text().contains("config reload refused"),
        "{}",
        router.log_text()
    );
    // A non-placement change applies at once.
    std::fs::write(
        &router.config,
        text.replace("[admin]", "[limits]\nmax_batch = 2\n\n[admin]"),
    )
    .unwrap();
    hup();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = renew_three().await;
        if r.status == 400 {
            assert!(r.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("1 to 2"));
            break;
        }
        assert!(Instant::now() < deadline, "the reload never applied: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(router.api.renew(&lock).await.status, 200);
    assert_eq!(router.api.get("/admin/v1/ring").await.body["epoch"], 1);
}

/// `--log-format json` (here through `LOCKROUTER_LOG_FORMAT`): every log
/// line is one JSON object, and the lines logged for a request carry the
/// request id the caller sent, which its answer returns too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_name_the_request_a_line_is_about() {
    let mut etcd = EtcdCluster::single();
    let port = free_port();
    let toml = lockrouter_testkit::config::config_toml(&[&etcd], &format!("127.0.0.1:{port}"), "");
    let router = RouterProcess::builder()
        .env("LOCKROUTER_LOG_FORMAT", "json")
        .spawn(&toml, port)
        .unwrap_or_else(|e| panic!("{e}"));
    router.api.wait_ready().await;
    router.api.must_acquire("logged", 5_000, "A").await;
    // A line logged inside a request's handling (a force-release's warn)
    // names the request under `span`, as the access log's does.
    router.api.must_acquire("forced", 5_000, "A").await;
    let req = (router.api.http)
        .post(format!(
            "{}/admin/v1/locks/forced/force-release",
            router.api.base
        ))
        .header("X-Request-Id", "force-7")
        .json(&serde_json::json!({"reason": "log test"}));
    let r = router.api.send(req).await;
    assert_eq!(r.status, 200, "{r:?}");
    let log = router.log_text();
    let forced = (log.lines())
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["fields"]["message"] == "lock force-released")
        .unwrap_or_else(|| panic!("no force-release line:\n{log}"));
    assert_eq!(forced["span"]["request_id"], "force-7", "{forced}");
    assert_eq!(forced["span"]["name"], "request", "{forced}");
    assert!(forced["span"]["shard"].is_string(), "{forced}");
    // The shard goes away: the next acquire fails with a 503, which the
    // router logs at warn with the request's id.
    etcd.kill();
    let req = router
        .api
        .http
        .post(format!("{}/api/v1/locks/acquire", router.api.base))
        .header("X-Request-Id", "trace-me-42")
        .json(&serde_json::json!({"name": "logged-2", "ttlMs": 5000, "clientId": "A"}));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = router.api.send(req.try_clone().unwrap()).await;
        assert_ne!(r.status, 200, "{r:?}");
        if r.status == 503 {
            assert_eq!(r.body["error"]["requestId"], "trace-me-42", "{r:?}");
            break;
        }
        assert!(Instant::now() < deadline, "{r:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = router.log_text();
        let lines: Vec<serde_json::Value> = log
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        assert!(
            lines
                .iter()
                .any(|l| l["fields"]["message"] == "lockrouter ready"),
            "{log}"
        );
        let about_it = lines.iter().any(|l| {
            l["span"]["request_id"] == "trace-me-42" || l["fields"]["request_id"] == "trace-me-42"
        });
        if about_it {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no line names the request:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The operator's subcommands against a running router: `inspect`,
/// `force-release`, `ring`, `reload` (URL and token from the environment,
/// as `LOCKROUTER_URL` / `LOCKROUTER_TOKEN`), their exit codes (0, 77 with
/// no or a wrong token, 64 for a bad request, 69 when no router answers),
/// and `completions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_inspect_and_force_release_from_the_command_line() {
    let etcd = EtcdCluster::single();
    let port = free_port();
    let token = "an-operator-token-0123";
    let toml = lockrouter_testkit::config::config_toml(&[&etcd], &format!("127.0.0.1:{port}"), "")
        + &format!("\n[admin]\ntoken = \"{token}\"\n");
    let router = RouterProcess::spawn(&toml, port);
    router.api.wait_ready().await;
    let held = router
        .api
        .must_acquire("nightly:batch", 30_000, "cron-7")
        .await;
    let url = format!("http://127.0.0.1:{port}");
    let run = |args: &[&str], token: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockrouter"));
        cmd.args(args)
            .env("LOCKROUTER_URL", &url)
            .env_remove("LOCKROUTER_TOKEN");
        if let Some(t) = token {
            cmd.env("LOCKROUTER_TOKEN", t);
        }
        let out = tokio::task::block_in_place(|| cmd.output().unwrap());
        let json = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default();
        (out.status.code(), json)
    };
    let (code, seen) = run(&["inspect", "nightly:batch"], Some(token));
    assert_eq!(code, Some(0), "{seen}");
    assert_eq!(
        (seen["held"].as_bool(), seen["clientId"].as_str()),
        (Some(true), Some("cron-7"))
    );
    let (code, page) = run(&["locks", "--prefix", "nightly:"], Some(token));
    assert_eq!(code, Some(0), "{page}");
    assert_eq!(page["locks"][0]["name"], "nightly:batch", "{page}");
    assert_eq!(page["locks"][0]["clientId"], "cron-7", "{page}");
    let (code, _) = run(&["locks"], None);
    assert_eq!(code, Some(77), "the listing is an admin route");
    let (code, view) = run(&["client", "cron-7"], Some(token));
    assert_eq!(code, Some(0), "{view}");
    assert_eq!(view["locks"][0]["fencingToken"].as_u64(), Some(held.1));
    assert_eq!(view["sessions"].as_array().map(Vec::len), Some(1), "{view}");
    // --all: every page, one lock a line.
    router
        .api
        .must_acquire("nightly:other", 30_000, "cron-8")
        .await;
    let all = tokio::task::block_in_place(|| {
        Command::new(env!("CARGO_BIN_EXE_lockrouter"))
            .args(["locks", "--all", "--limit", "1", "--prefix", "nightly:"])
            .env("LOCKROUTER_URL", &url)
            .env("LOCKROUTER_TOKEN", token)
            .output()
            .unwrap()
    });
    assert!(all.status.success(), "{all:?}");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&all.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let (code, _) = run(
        &["force-release", "nightly:batch", "--reason", "hung"],
        None,
    );
    assert_eq!(code, Some(77), "no token");
    let (code, _) = run(
        &["force-release", "nightly:batch", "--reason", "hung"],
        Some("wrong-token-wrong"),
    );
    assert_eq!(code, Some(77), "wrong token");
    let (code, _) = run(
        &["force-release", "nightly:batch", "--reason", " "],
        Some(token),
    );
    assert_eq!(code, Some(64), "an empty reason is a bad request");
    let (code, forced) = run(
        &[
            "force-release",
            "nightly:batch",
            "--reason",
            "hung since 02:00",
        ],
        Some(token),
    );
    assert_eq!(code, Some(0), "{forced}");
    assert_eq!(
        (
            forced["released"].as_bool(),
            forced["fencingToken"].as_u64()
        ),
        (Some(true), Some(held.1))
    );
    assert_eq!(router.api.renew(&held).await.status, 409);
    assert!(router.log_text().contains("lock force-released"));
    let (code, ring) = run(&["ring"], Some(token));
    assert_eq!(code, Some(0), "{ring}");
    assert!(ring["ring"].is_string(), "{ring}");
    let (code, reloaded) = run(&["reload"], Some(token));
    assert_eq!(code, Some(0), "{reloaded}");
    assert_eq!(reloaded["placementChanged"], false, "{reloaded}");
    // Nobody listening: 69.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockrouter"));
    cmd.args([
        "ring",
        "--url",
        &format!("http://127.0.0.1:{}", free_port()),
    ]);
    let out = tokio::task::block_in_place(|| cmd.output().unwrap());
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    let out = tokio::task::block_in_place(|| {
        Command::new(env!("CARGO_BIN_EXE_lockrouter"))
            .args(["completions", "bash"])
            .output()
            .unwrap()
    });
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("force-release"));
}

/// `server.worker_threads` sizes the runtime that serves requests: with 1,
/// the router runs one worker (`lockrouter_runtime_workers`) and serves the
/// lock API as ever; with 0, one per core.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_threads_sizes_the_runtime() {
    let etcd = EtcdCluster::single();
    let cores = std::thread::available_parallelism().unwrap().get();
    for (threads, expected) in [(1, 1), (0, cores)] {
        let extra = format!("[server]\nworker_threads = {threads}\n");
        let port = free_port();
        // `[server]` comes first in the generated config: add the key there.
        let toml = lockrouter_testkit::config::config_toml(&[&etcd], "127.0.0.1:0", "")
            .replacen("[server]\n", &extra, 1)
            .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
        let router = RouterProcess::spawn(&toml, port);
        router.api.wait_ready().await;
        let workers = lockrouter_testkit::metrics::sum(
            &router.api.metrics().await,
            "lockrouter_runtime_workers",
            &[],
        );
        assert_eq!(workers, expected as f64, "worker_threads = {threads}");
        let lock = router
            .api
            .must_acquire(&format!("threads-{threads}"), 10_000, "w")
            .await;
        assert_eq!(router.api.renew(&lock).await.status, 200);
        assert_eq!(router.api.release(&lock).await.status, 204);
    }
}
