//! The command line as scripts use it: every command that calls a router
//! takes the same connection flags and variables (`--url`,
//! `LOCKROUTER_URL`, `LOCKROUTER_TOKEN`, `LOCKROUTER_CA_FILE`), `exec`
//! included; a reload the router refuses for now exits 75 (try again
//! later); and `config check` prints one JSON document on stdout, and
//! names a variable that sets no key as a variable.

use std::process::{Command, Output};

use serde_json::Value;

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
        "reload",
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
