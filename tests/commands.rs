//! The command line as scripts and people use it: every command that
//! calls a router takes the same connection flags and variables (`--url`,
//! `LOCKROUTER_URL`, `LOCKROUTER_TOKEN`, `LOCKROUTER_CA_FILE`), `exec`
//! included; a reload the router refuses for now exits 75 (try again
//! later); the reading commands print a table, JSON (keys sorted) or
//! YAML, JSON by default when piped; `status` and `bump-epoch` do what
//! their curl calls did; `config check` and `plan -o json` print one JSON
//! document on stdout, and `config check` names a variable that sets no
//! key as a variable; shell completions know every command.

use std::process::{Command, Output};

use serde_json::{json, Value};

use lockrouter_testkit::config::config_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router::{FileRouter, TestRouter};

use crate::tls::TlsRouter;

/// `lockrouter ARGS` with none of the connection variables set but `env`.
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockrouter"));
    cmd.args(args);
    for var in ["LOCKROUTER_URL", "LOCKROUTER_TOKEN", "LOCKROUTER_CA_FILE"] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    tokio::task::block_in_place(|| cmd.output().unwrap())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Every command that calls a router documents the same flags and
/// variables, and `exec` finds its router through them like the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_that_calls_a_router_takes_the_same_connection_flags() {
    for command in [
        "inspect",
        "force-release",
        "locks",
        "client",
        "ring",
        "status",
        "reload",
        "bump-epoch",
        "exec",
    ] {
        let help = text(&run(&[command, "--help"], &[]).stdout);
        for flag in [
            "--url",
            "LOCKROUTER_URL",
            "--token",
            "LOCKROUTER_TOKEN",
            "--ca-file",
            "LOCKROUTER_CA_FILE",
        ] {
            assert!(
                help.contains(flag),
                "`{command} --help` lacks {flag}:\n{help}"
            );
        }
    }
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let base = router.api.base.as_str();
    let report = "echo \"token $LOCKROUTER_FENCING_TOKEN\"";
    let exec = [
        "exec", "--name", "cli:exec", "--ttl", "5s", "--", "sh", "-c", report,
    ];
    let by_env = run(&exec, &[("LOCKROUTER_URL", base)]);
    assert_eq!(by_env.status.code(), Some(0), "{by_env:?}");
    assert!(text(&by_env.stdout).starts_with("token "), "{by_env:?}");
    let by_flag = run(&[&["exec", "--url", base], &exec[1..]].concat(), &[]);
    assert_eq!(by_flag.status.code(), Some(0), "{by_flag:?}");
    // The operator's commands take the same variable.
    let ring = run(&["ring"], &[("LOCKROUTER_URL", base)]);
    assert_eq!(ring.status.code(), Some(0), "{ring:?}");
}

/// `exec` reaches a TLS router through `LOCKROUTER_URL` and
/// `LOCKROUTER_CA_FILE`, as the operator's commands do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_trusts_the_ca_named_in_the_environment() {
    let etcd = EtcdCluster::single();
    let router = TlsRouter::start(&etcd).await;
    let (base, ca) = (&router.base, &router.ca);
    let exec = ["exec", "--name", "cli:tls", "--ttl", "5s", "--", "true"];
    let env = [
        ("LOCKROUTER_URL", base.as_str()),
        ("LOCKROUTER_CA_FILE", ca),
    ];
    let out = run(&exec, &env);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let untrusting = run(&exec, &env[..1]);
    assert_eq!(untrusting.status.code(), Some(69), "{untrusting:?}");
}

/// A reload the router refuses for now (a new shard it cannot reach)
/// exits 75, EX_TEMPFAIL: try again later. One it applies exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_refused_for_now_exits_75() {
    let etcd = EtcdCluster::single();
    let toml = config_toml(&[&etcd], "127.0.0.1:0", "");
    let router = FileRouter::start(&toml).await;
    let base = router.api.base.as_str();
    let ok = run(&["reload", "--url", base], &[]);
    assert_eq!(ok.status.code(), Some(0), "{ok:?}");
    let dead = format!(
        "{toml}\n[[shards]]\nname = \"b\"\nendpoints = [\"http://127.0.0.1:{}\"]\n",
        free_port()
    );
    std::fs::write(&router.path, dead).unwrap();
    let refused = run(&["reload", "--url", base], &[]);
    let answer: Value = serde_json::from_slice(&refused.stdout).unwrap_or_default();
    assert_eq!(
        answer["error"]["code"], "failed_precondition",
        "{refused:?}"
    );
    assert_eq!(refused.status.code(), Some(75), "{refused:?}");
    let out = run(&["reload", "--help"], &[]);
    assert!(text(&out.stdout).contains("75"), "{out:?}");
}

/// `config check` prints exactly one JSON document on stdout (the
/// effective settings), so that it pipes into `jq`; the summary goes to
/// stderr. A `LOCKROUTER__…` variable that sets no key is named, as a
/// variable from the environment, by `config check` and `serve` alike.
#[test]
fn config_check_prints_json_only_and_names_a_variable_that_sets_no_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("router.toml");
    std::fs::write(
        &path,
        "[server]\nlisten = \"127.0.0.1:0\"\n[[shards]]\nname = \"a\"\nendpoints = [\"http://127.0.0.1:2379\"]\n",
    )
    .unwrap();
    let path = path.to_str().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
        .args(["config", "check", "--config", path])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let effective: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {out:?}"));
    assert_eq!(effective["shards"][0]["name"], "a", "{effective}");
    assert!(text(&out.stderr).contains("valid"), "{out:?}");
    for command in [&["config", "check"][..], &["serve"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_lockrouter"))
            .args(command)
            .args(["--config", path])
            .env("LOCKROUTER__SERVER__LISTNE", "0.0.0.0:1")
            .output()
            .unwrap();
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command:?}: {out:?}");
        for needle in ["LOCKROUTER__SERVER__LISTNE", "environment", "server.listne"] {
            assert!(
                stderr.contains(needle),
                "{command:?}: {stderr:?} should mention {needle:?}"
            );
        }
        assert!(out.stdout.is_empty(), "{command:?}: {out:?}");
    }
}

/// The admin token of [`operators_router`].
const ADMIN: &str = "cli-admin-token-0123456789";

/// One etcd shard and a router with an admin token, holding two locks
/// (`cli:a` with metadata, `cli:b`), for the reading commands' tests.
async fn operators_router(etcd: &EtcdCluster) -> TestRouter {
    let extra = format!("\n[admin]\ntoken = \"{ADMIN}\"\n");
    let router = TestRouter::with_toml(&config_toml(&[etcd], "127.0.0.1:0", &extra)).await;
    let acquire = |name: &str, client: &str| serde_json::json!({"name": name, "ttlMs": 30_000, "clientId": client, "metadata": {"job": name}});
    for (name, client) in [("cli:a", "worker-a"), ("cli:b", "worker-b")] {
        let r = router
            .api
            .post("/api/v1/locks/acquire", acquire(name, client))
            .await;
        assert_eq!(r.body["acquired"], true, "{r:?}");
    }
    router
}

/// `lockrouter ARGS` against `base` with the admin token.
fn admin(base: &str, args: &[&str]) -> Output {
    run(
        args,
        &[("LOCKROUTER_URL", base), ("LOCKROUTER_TOKEN", ADMIN)],
    )
}

/// The cells of each line of a table, split on runs of spaces (no cell
/// of these tables holds two spaces in a row).
fn cells(table: &str) -> Vec<Vec<String>> {
    table
        .lines()
        .map(|l| {
            l.split("   ")
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty())
                .collect()
        })
        .filter(|row: &Vec<String>| !row.is_empty())
        .collect()
}

/// Seconds of a `LEFT` cell such as `29s`; panics on anything else.
fn seconds(cell: &str) -> u64 {
    cell.strip_suffix('s')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a time left in seconds: {cell:?}"))
}

/// `locks`, `inspect`, `client` and `ring` as a table (headers, each
/// lock's expiry and time left), as JSON when piped (the router's answer
/// with its keys sorted) and as YAML; an error answer goes to stderr at a
/// table and to stdout as JSON, with the same exit code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_commands_print_tables_json_and_yaml() {
    let etcd = EtcdCluster::single();
    let router = operators_router(&etcd).await;
    let base = router.api.base.as_str();

    let out = admin(base, &["locks", "--prefix", "cli:", "-o", "table"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let table = cells(&text(&out.stdout));
    let header = [
        "NAME", "SHARD", "TOKEN", "CLIENT", "TTL", "AGE", "EXPIRES", "LEFT",
    ];
    assert_eq!(table[0], header, "{table:?}");
    assert_eq!(table.len(), 3, "{table:?}");
    for row in &table[1..] {
        let expires = humantime::parse_rfc3339(&row[6])
            .unwrap_or_else(|e| panic!("EXPIRES {:?}: {e}", row[6]));
        let now = std::time::SystemTime::now();
        assert!(expires > now, "{row:?}");
        assert!((20..=30).contains(&seconds(&row[7])), "{row:?}");
        assert_eq!(row[4], "30s", "{row:?}");
        let inspected = router.api.inspect(&row[0]).await.body;
        assert_eq!(row[2], inspected["fencingToken"].to_string(), "{row:?}");
    }

    // Piped, with no -o: the page as JSON, every object's keys sorted.
    let out = admin(base, &["locks", "--prefix", "cli:"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let raw = text(&out.stdout);
    let page: Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{e}: {raw}"));
    let names: Vec<&str> = page["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{page}");
    let keys = [
        "acquiredAt",
        "clientId",
        "fencingToken",
        "metadata",
        "name",
        "shard",
        "ttlMs",
    ];
    let at: Vec<usize> = keys
        .iter()
        .map(|k| raw.find(&format!("\"{k}\"")).unwrap())
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "keys not sorted: {raw}");

    let out = admin(base, &["locks", "--prefix", "cli:", "-o", "yaml"]);
    let docs = yaml_rust2::YamlLoader::load_from_str(&text(&out.stdout)).unwrap();
    assert_eq!(docs[0]["locks"].as_vec().map(Vec::len), Some(2), "{out:?}");

    let out = admin(base, &["inspect", "cli:a", "-o", "table"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let fields = text(&out.stdout);
    for line in [
        "NAME       cli:a",
        "HELD       yes",
        "CLIENT     worker-a",
        "METADATA   {\"job\":\"cli:a\"}",
    ] {
        assert!(fields.lines().any(|l| l == line), "{line:?} in:\n{fields}");
    }
    let left = fields.lines().find_map(|l| l.strip_prefix("LEFT")).unwrap();
    assert!((20..=30).contains(&seconds(left.trim())), "{fields}");

    let out = admin(base, &["client", "worker-b", "-o", "table"]);
    let view = text(&out.stdout);
    assert!(view.contains("\nSESSION LEASES\n"), "{view}");
    assert!(view.lines().any(|l| l.starts_with("cli:b ")), "{view}");

    let ring: Value = serde_json::from_slice(&admin(base, &["ring", "-o", "json"]).stdout).unwrap();
    let out = admin(base, &["ring", "-o", "table"]);
    let fields = text(&out.stdout);
    let fingerprint = ring["ring"].as_str().unwrap();
    assert!(
        fields.starts_with(&format!("RING        {fingerprint}\n")),
        "{fields}"
    );

    // An error answer: a line on stderr at a table, JSON on stdout piped.
    let out = admin(base, &["locks", "--limit", "0", "-o", "table"]);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(text(&out.stderr).contains("invalid_argument"), "{out:?}");
    let out = admin(base, &["locks", "--limit", "0"]);
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    let error: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(error["error"]["code"], "invalid_argument", "{out:?}");
}

/// `status` is `/readyz` and the ring as a table or JSON: the version,
/// every shard's state and the ring's epoch; without the admin credential
/// the ring is left out and it still exits 0. `bump-epoch` records the
/// next epoch (status shows it), and a refused bump exits 75.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_bump_epoch_do_what_their_curl_calls_did() {
    let etcd = EtcdCluster::single();
    let router = operators_router(&etcd).await;
    let base = router.api.base.as_str();

    let out = admin(base, &["status"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let status: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(
        status["readyz"]["version"],
        env!("CARGO_PKG_VERSION"),
        "{status}"
    );
    assert_eq!(status["readyz"]["shards"][0]["state"], "up", "{status}");
    let epoch = status["ring"]["epoch"].as_u64().expect("the ring's epoch");

    let out = admin(base, &["bump-epoch"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let bumped: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(bumped["epoch"].as_u64(), Some(epoch + 1), "{out:?}");
    let refused = admin(base, &["bump-epoch", "--reinitialize", "nosuch"]);
    assert_eq!(refused.status.code(), Some(75), "{refused:?}");

    let out = admin(base, &["status", "-o", "table"]);
    let table = text(&out.stdout);
    let version = format!("VERSION     {}\n", env!("CARGO_PKG_VERSION"));
    assert!(table.starts_with(&version), "{table}");
    assert!(table.contains("READY       yes\n"), "{table}");
    assert!(
        table.contains(&format!("(epoch {}, granting)", epoch + 1)),
        "{table}"
    );
    let rows = cells(&table);
    let a = rows
        .iter()
        .find(|r| r[0] == "a")
        .expect("a row for shard a");
    assert_eq!(
        a[1..],
        ["up", "active", "1", &(epoch + 1).to_string()],
        "{table}"
    );

    // Without the admin token: /readyz alone, still exit 0.
    let out = run(&["status", "-o", "table"], &[("LOCKROUTER_URL", base)]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let table = text(&out.stdout);
    assert!(table.contains("admin credential"), "{table}");
    let out = run(&["status", "-o", "json"], &[("LOCKROUTER_URL", base)]);
    let status: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert_eq!(
        (&status["readyz"]["ready"], &status["ring"]),
        (&json!(true), &Value::Null)
    );
}

/// The output flags of the commands that keep their output: `plan -o
/// json` is `plan --json`, `config check` takes `-o json` only; and the
/// shell completions know the new commands and `-o`.
#[test]
fn plan_and_config_check_take_o_json_and_completions_know_every_command() {
    let plan = [
        "plan",
        "--locks",
        "1000",
        "--clients",
        "10",
        "--acquires-per-sec",
        "5",
    ];
    let by_flag = run(&[&plan[..], &["--json"]].concat(), &[]);
    let by_o = run(&[&plan[..], &["-o", "json"]].concat(), &[]);
    assert_eq!(by_o.status.code(), Some(0), "{by_o:?}");
    assert_eq!(by_o.stdout, by_flag.stdout);
    assert!(
        serde_json::from_slice::<Value>(&by_o.stdout).is_ok(),
        "{by_o:?}"
    );
    let table = run(&plan, &[]);
    assert!(
        serde_json::from_slice::<Value>(&table.stdout).is_err(),
        "a table by default"
    );

    let check = |format: &str| {
        run(
            &[
                "config",
                "check",
                "--config",
                "/nonexistent.toml",
                "-o",
                format,
            ],
            &[],
        )
    };
    assert_eq!(check("table").status.code(), Some(2), "only json");
    assert!(text(&check("table").stderr).contains("invalid value"));

    // fish spells a flag `-l output`.
    for (shell, flag) in [("bash", "--"), ("zsh", "--"), ("fish", "-l ")] {
        let script = text(&run(&["completions", shell], &[]).stdout);
        let flags = [format!("{flag}output"), format!("{flag}reinitialize")];
        for word in ["status", "bump-epoch", &flags[0], &flags[1]] {
            assert!(script.contains(word), "{shell} completions lack {word}");
        }
    }
}
