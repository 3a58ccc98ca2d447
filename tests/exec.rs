//! `lockrouter exec` as a user runs it: the command gets the lock in its
//! environment and exec passes its exit code on; a held lock means exit 75
//! and nothing run; `--wait` queues for the lock; SIGTERM is forwarded; a lost lock stops
//! the command (SIGKILL after the grace period) with exit 79; the lock is
//! released whenever exec ends; a missing command, an unreachable router
//! and a malformed URL each have their own exit code.

use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use lockrouter_testkit::bins::lockrouter;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::procs::Proc;
use lockrouter_testkit::router::TestRouter;
use lockrouter_testkit::sleep_ms;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// `lockrouter exec` for `name` with `flags`, running `sh -c script`.
fn exec(router: &TestRouter, name: &str, flags: &[&str], script: &str) -> Command {
    let mut cmd = Command::new(lockrouter());
    cmd.args(["exec", "--router", &router.api.base, "--name", name])
        .args(flags)
        .args(["--", "sh", "-c", script]);
    cmd
}

async fn output(mut cmd: Command) -> (Option<i32>, String, String) {
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn line(text: &'static str) -> impl Fn(&Value) -> bool {
    move |v| v.as_str() == Some(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_runs_with_the_lock_in_its_environment_and_its_exit_code_passes_through() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let script =
        "echo \"$LOCKROUTER_FENCING_TOKEN|$LOCKROUTER_LOCK_NAME|$LOCKROUTER_LOCK_ID\"; exit 3";
    let (code, stdout, stderr) = output(exec(&router, "exec:env", &["--ttl", "5s"], script)).await;
    assert_eq!(code, Some(3), "{stderr}");
    let parts: Vec<&str> = stdout.trim().split('|').collect();
    assert_eq!(parts.len(), 3, "{stdout:?}");
    let token: u64 = parts[0].parse().expect("numeric fencing token");
    assert!(token > 0);
    assert_eq!(parts[1], "exec:env");
    assert!(!parts[2].is_empty());
    // Released on exit: the name is free and a later grant is larger.
    assert_eq!(router.api.inspect("exec:env").await.body["held"], false);
    let (_, next) = router.api.must_acquire("exec:env", 5_000, "after").await;
    assert!(next > token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_exits_75_without_running_the_command_and_wait_queues_for_it() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let holder = router.api.must_acquire("exec:busy", 30_000, "other").await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let script = format!("touch {}", marker.display());

    let (code, _, stderr) = output(exec(&router, "exec:busy", &["--ttl", "5s"], &script)).await;
    assert_eq!(code, Some(75), "{stderr}");
    assert!(stderr.contains("held by another client"), "{stderr}");
    let (code, _, _) = output(exec(
        &router,
        "exec:busy",
        &["--ttl", "5s", "--wait", "1s"],
        &script,
    ))
    .await;
    assert_eq!(code, Some(75), "still held after waiting 1 s");
    assert!(
        !marker.exists(),
        "the command must not run without the lock"
    );

    // With a longer wait, exec gets the lock once the holder lets go.
    let waiting = tokio::spawn(output(exec(
        &router,
        "exec:busy",
        &["--ttl", "5s", "--wait", "30s"],
        &script,
    )));
    sleep_ms(1_000).await;
    assert_eq!(router.api.release(&holder).await.status, 204);
    let (code, _, stderr) = waiting.await.unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(marker.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_forwarded_to_the_command_and_the_lock_released() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let script = "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.1; done";
    let mut p = Proc::spawn("exec", exec(&router, "exec:term", &["--ttl", "5s"], script));
    p.wait_for(secs(20), line("ready"));
    assert_eq!(router.api.inspect("exec:term").await.body["held"], true);
    p.signal(Signal::SIGTERM);
    let status = p.wait_exit(secs(20));
    assert_eq!(status.code(), Some(7), "{:?}", p.seen);
    assert!(p.seen.iter().any(|v| v.as_str() == Some("got-term")));
    assert_eq!(router.api.inspect("exec:term").await.body["held"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_stops_the_command_with_sigkill_after_the_grace_period() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    // The command ignores SIGTERM, so only SIGKILL ends it.
    let script = "trap '' TERM; echo \"$LOCKROUTER_LOCK_ID $LOCKROUTER_FENCING_TOKEN\"; \
                  while :; do sleep 0.1; done";
    let mut p = Proc::spawn(
        "exec",
        exec(
            &router,
            "exec:lost",
            &["--ttl", "3s", "--grace", "1s"],
            script,
        ),
    );
    let first = p.wait_for(secs(20), |v| v.is_string());
    let (id, token) = first
        .as_str()
        .and_then(|s| s.split_once(' '))
        .expect("lock id and token");
    let lock = (id.to_string(), token.parse::<u64>().unwrap());
    // Released behind exec's back: its next renewal hears "expired".
    assert_eq!(router.api.release(&lock).await.status, 204);
    let status = p.wait_exit(secs(30));
    assert_eq!(status.code(), Some(79), "{:?}", p.seen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_command_exits_127_an_unreachable_router_69_a_bad_url_2() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let mut cmd = Command::new(lockrouter());
    cmd.args([
        "exec",
        "--router",
        &router.api.base,
        "--name",
        "exec:missing",
    ])
    .args(["--ttl", "5s", "--", "/nonexistent/command"]);
    let (code, _, stderr) = output(cmd).await;
    assert_eq!(code, Some(127), "{stderr}");
    assert_eq!(router.api.inspect("exec:missing").await.body["held"], false);

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cmd = Command::new(lockrouter());
    cmd.args(["exec", "--router", &format!("http://127.0.0.1:{port}")])
        .args(["--name", "x", "--ttl", "5s", "--", "true"]);
    let (code, _, stderr) = output(cmd).await;
    assert_eq!(code, Some(69), "{stderr}");
    assert!(stderr.contains("cannot reach the router"), "{stderr}");

    let mut cmd = Command::new(lockrouter());
    cmd.args(["exec", "--router", "127.0.0.1:8080", "--name", "x"])
        .args(["--ttl", "5s", "--", "true"]);
    let (code, _, stderr) = output(cmd).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("http://host:port"), "{stderr}");
}

/// SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to exec reach the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hup_quit_usr1_and_usr2_are_forwarded_to_the_command() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let script = "for s in HUP QUIT USR1 USR2; do trap \"echo got-$s\" $s; done; \
                  echo ready; while :; do sleep 0.1; done";
    let mut p = Proc::spawn("exec", exec(&router, "exec:sigs", &["--ttl", "5s"], script));
    p.wait_for(secs(20), line("ready"));
    for (sig, seen) in [
        (Signal::SIGHUP, "got-HUP"),
        (Signal::SIGQUIT, "got-QUIT"),
        (Signal::SIGUSR1, "got-USR1"),
        (Signal::SIGUSR2, "got-USR2"),
    ] {
        p.signal(sig);
        p.wait_for(secs(10), move |v| v.as_str() == Some(seen));
    }
    p.signal(Signal::SIGTERM);
    p.wait_exit(secs(20));
    assert_eq!(router.api.inspect("exec:sigs").await.body["held"], false);
}

/// If exec dies, even by SIGKILL, the command dies with it: it must not
/// run on without the lock nobody renews any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_dies_with_exec() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let script = "echo \"pid $$\"; while :; do sleep 0.1; done";
    let mut p = Proc::spawn(
        "exec",
        exec(&router, "exec:orphan", &["--ttl", "5s"], script),
    );
    let first = p.wait_for(secs(20), |v| {
        v.as_str().is_some_and(|s| s.starts_with("pid "))
    });
    let pid: i32 = first.as_str().unwrap()[4..].parse().unwrap();
    p.signal(Signal::SIGKILL);
    p.wait_exit(secs(10));
    let gone = std::time::Instant::now() + secs(5);
    while std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
    {
        assert!(
            std::time::Instant::now() < gone,
            "the command {pid} outlived exec"
        );
        sleep_ms(50).await;
    }
}

/// A request the router refuses as malformed (a TTL below its minimum) is
/// a usage error, 64, not "unavailable" (69).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_the_router_refuses_exits_64() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let (code, _, stderr) = output(exec(&router, "exec:short", &["--ttl", "500ms"], "true")).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("ttlMs"), "{stderr}");
}

/// A `--wait` longer than the router's `limits.max_wait_ms` queues again
/// after each wait the router accepts, instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_longer_than_the_routers_limit_queues_again() {
    let etcd = EtcdCluster::single();
    let toml = lockrouter_testkit::config::config_toml(&[&etcd], "127.0.0.1:0", "")
        + "\n[limits]\nmax_wait_ms = 2000\n";
    let router = TestRouter::with_toml(&toml).await;
    let holder = router
        .api
        .must_acquire("exec:long-wait", 30_000, "other")
        .await;
    let waiting = tokio::spawn(output(exec(
        &router,
        "exec:long-wait",
        &["--ttl", "5s", "--wait", "20s"],
        "echo ran",
    )));
    sleep_ms(4_500).await;
    assert!(
        !waiting.is_finished(),
        "exec gave up before the lock was free"
    );
    assert_eq!(router.api.release(&holder).await.status, 204);
    let (code, stdout, stderr) = waiting.await.unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout.trim(), "ran");
}
