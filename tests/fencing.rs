//! The fencing story with real paused processes: a holder is stopped
//! (SIGSTOP) for longer than its TTL, another process takes the lock and
//! writes, and when the holder resumes, the SQLite resource of
//! `examples/fenced_worker` rejects its stale writes and the holder learns
//! it lost the lock. Once through the client SDK, once through
//! `lockrouter exec`, whose child keeps running while its holder is paused.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;

use lockrouter_testkit::bins::{example, lockrouter};
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::procs::{is, Proc};
use lockrouter_testkit::router::TestRouter;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn accepted_write(v: &Value) -> bool {
    v["event"] == "write" && v["accepted"] == true
}

fn rejected_write(v: &Value) -> bool {
    v["event"] == "write" && v["accepted"] == false
}

fn token(v: &Value) -> u64 {
    v["token"].as_u64().expect("event has a token")
}

/// The `fenced_worker` example of this package, built if it is stale.
fn fenced_worker() -> PathBuf {
    example(env!("CARGO_MANIFEST_DIR"), "fenced_worker")
}

/// `fenced_worker hold`: acquires `name` through the SDK and writes.
fn holder(router: &str, db: &Path, name: &str, client: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(fenced_worker());
    cmd.args(["hold", "--router", router, "--name", name, "--ttl", "2s"])
        .args(["--client-id", client, "--interval", "100ms", "--db"])
        .arg(db)
        .args(extra);
    cmd
}

/// Every accepted write of `resource`, in commit order: `(token, payload)`.
fn rows(db: &Path, resource: &str) -> Vec<(u64, String)> {
    let conn = rusqlite::Connection::open(db).unwrap();
    conn.busy_timeout(secs(10)).unwrap();
    let mut stmt = conn
        .prepare("SELECT token, payload FROM writes WHERE resource = ?1 ORDER BY seq")
        .unwrap();
    let rows = stmt
        .query_map([resource], |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?)))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    rows
}

/// Asserts that once `new` (the later holder's token) appears in the
/// resource, no write with any other token follows; returns the number of
/// writes under `new`.
fn only_new_writes_after_first(db: &Path, resource: &str, new: u64) -> usize {
    let rows = rows(db, resource);
    let first = rows
        .iter()
        .position(|(t, _)| *t == new)
        .unwrap_or_else(|| panic!("no write under {new}: {rows:?}"));
    let after = &rows[first..];
    assert!(
        after.iter().all(|(t, _)| *t == new),
        "a stale write landed after the new holder's first write: {rows:?}"
    );
    after.len()
}

/// Pauses `p` right after one of its writes, making sure it was not stopped
/// inside an SQLite transaction (that would hold the database's write lock
/// and stall every other writer, which is not the scenario under test).
fn pause_between_writes(p: &mut Proc, db: &Path) {
    for _ in 0..20 {
        p.wait_new(secs(10), accepted_write);
        p.pause();
        let conn = rusqlite::Connection::open(db).unwrap();
        conn.busy_timeout(Duration::from_millis(300)).unwrap();
        if conn.execute_batch("BEGIN IMMEDIATE; ROLLBACK;").is_ok() {
            return;
        }
        p.signal(Signal::SIGCONT);
    }
    panic!("could not pause the holder outside a transaction");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sdk_holder_is_fenced_out_and_learns_it_lost_the_lock() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let url = router.api.base.clone();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("orders.db");

    let mut a = Proc::spawn(
        "holder A",
        holder(&url, &db, "order:42", "A", &["--writes-after-lost", "3"]),
    );
    let token_a = token(&a.wait_for(secs(20), is("acquired")));
    pause_between_writes(&mut a, &db);

    // A stays stopped well past its 2 s TTL while B polls for the lock.
    let mut b = Proc::spawn(
        "holder B",
        holder(
            &url,
            &db,
            "order:42",
            "B",
            &["--wait", "30s", "--writes", "5"],
        ),
    );
    let token_b = token(&b.wait_for(secs(40), is("acquired")));
    assert!(
        token_b > token_a,
        "B's token {token_b} must exceed A's {token_a}"
    );
    b.wait_for(secs(10), accepted_write);

    a.drain();
    let resumed_at = a.seen.len();
    a.signal(Signal::SIGCONT);
    let lost = a.wait_for(secs(20), is("lost"));
    assert_eq!(
        lost["reason"], "validity ran out without a confirmed renewal",
        "A was paused, so its own clock, not the router, tells it first"
    );
    let status = a.wait_exit(secs(20));
    assert_eq!(status.code(), Some(79), "A exits as lost: {:?}", a.seen);
    let after: Vec<&Value> = a.seen[resumed_at..]
        .iter()
        .filter(|v| v["event"] == "write")
        .collect();
    assert!(
        after
            .iter()
            .any(|v| rejected_write(v) && v["highest"] == token_b),
        "A's stale writes must be rejected by the resource: {after:?}"
    );

    assert!(b.wait_exit(secs(20)).success(), "{:?}", b.seen);
    assert_eq!(only_new_writes_after_first(&db, "order:42", token_b), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_stops_the_command_of_a_paused_holder_that_lost_its_lock() {
    let etcd = EtcdCluster::single();
    let router = TestRouter::start(&[&etcd]).await;
    let url = router.api.base.clone();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("orders.db");

    let mut cmd = Command::new(lockrouter());
    cmd.args([
        "exec", "--router", &url, "--name", "order:43", "--ttl", "2s",
    ])
    .args(["--client-id", "H", "--grace", "5s", "--"])
    .arg(fenced_worker())
    .args(["child", "--interval", "100ms", "--db"])
    .arg(&db);
    let mut exec = Proc::spawn("lockrouter exec", cmd);
    let token_h = token(&exec.wait_for(secs(20), is("start")));
    exec.wait_new(secs(10), accepted_write);
    // Only the holder is paused: its command keeps writing with its token.
    exec.pause();

    let mut b = Proc::spawn(
        "holder B",
        holder(
            &url,
            &db,
            "order:43",
            "B",
            &["--wait", "30s", "--writes", "5"],
        ),
    );
    let token_b = token(&b.wait_for(secs(40), is("acquired")));
    assert!(token_b > token_h);
    b.wait_for(secs(10), accepted_write);
    // The command, still running, is now fenced out by the resource.
    let rejected = exec.wait_new(secs(10), rejected_write);
    assert_eq!(rejected["highest"], token_b);

    exec.signal(Signal::SIGCONT);
    exec.wait_for(secs(20), is("stopped"));
    let status = exec.wait_exit(secs(30));
    assert_eq!(
        status.code(),
        Some(79),
        "exec exits with the lost code: {:?}",
        exec.seen
    );

    assert!(b.wait_exit(secs(20)).success(), "{:?}", b.seen);
    assert_eq!(only_new_writes_after_first(&db, "order:43", token_b), 5);
}
