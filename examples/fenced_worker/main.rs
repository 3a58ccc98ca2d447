//! A worker that writes to a fenced SQLite resource under a lockrouter lock:
//! the fencing story end to end, runnable by hand and used by the tests.
//!
//! ```sh
//! # holds order:42 through the client SDK and appends to it every 200 ms
//! cargo run --example fenced_worker -- hold --router http://127.0.0.1:8080 \
//!     --db /tmp/orders.db --name order:42 --ttl 2s --writes 20
//! # the same writer as a child of `lockrouter exec` (token from the environment)
//! lockrouter exec --router http://127.0.0.1:8080 --name order:42 --ttl 2s -- \
//!     target/debug/examples/fenced_worker child --db /tmp/orders.db
//! ```
//!
//! Every write carries the lock's fencing token, and the store
//! (`store.rs`) rejects writes older than the newest it has seen. To show
//! that this, not the client's vigilance, is what keeps the data right, the
//! worker does not check `is_held()` before writing: it behaves like a
//! process that checked and was then paused. A real worker stops writing
//! when `lost()` fires; this one keeps trying `--writes-after-lost` more
//! times so the rejections can be seen. Each event is a JSON line on stdout.

mod store;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Parser, Subcommand};
use lockrouter_client::Client;
use serde_json::json;
use store::{FencedStore, Write};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Acquire the lock with the client SDK and write under it.
    Hold {
        #[arg(long)]
        router: String,
        #[arg(long)]
        db: PathBuf,
        #[arg(long)]
        name: String,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
        ttl: Duration,
        #[arg(long)]
        client_id: Option<String>,
        /// Wait (queued at the router) this long for the lock if it is held.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
        wait: Duration,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "200ms")]
        interval: Duration,
        /// Stop (and release) after this many writes; default: until lost.
        #[arg(long)]
        writes: Option<u64>,
        /// Writes still attempted after the lock was lost, to show the
        /// resource rejecting them.
        #[arg(long, default_value_t = 3)]
        writes_after_lost: u64,
    },
    /// Write under the lock `lockrouter exec` holds for this process, with
    /// the token from LOCKROUTER_FENCING_TOKEN, until stopped.
    Child {
        #[arg(long)]
        db: PathBuf,
        #[arg(long, value_parser = humantime::parse_duration, default_value = "200ms")]
        interval: Duration,
    },
}

fn emit(event: serde_json::Value) {
    // stdout is line-buffered: each event reaches a pipe whole and at once.
    println!("{event}");
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Cli::parse().mode {
        Mode::Hold {
            router,
            db,
            name,
            ttl,
            client_id,
            wait,
            interval,
            writes,
            writes_after_lost,
        } => {
            let opts = HoldOptions {
                interval,
                writes,
                writes_after_lost,
            };
            hold(&router, &db, &name, ttl, client_id.as_deref(), wait, opts).await
        }
        Mode::Child { db, interval } => child(&db, interval).await,
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("fenced_worker: {e}");
            ExitCode::from(70)
        }
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct HoldOptions {
    interval: Duration,
    writes: Option<u64>,
    writes_after_lost: u64,
}

async fn hold(
    router: &str,
    db: &std::path::Path,
    name: &str,
    ttl: Duration,
    client_id: Option<&str>,
    wait: Duration,
    opts: HoldOptions,
) -> Res<u8> {
    let store = Arc::new(Mutex::new(FencedStore::open(db)?));
    let client = Client::new(router, client_id)?;
    let Some(lock) = client.acquire_wait(name, ttl, wait).await? else {
        emit(json!({"event": "not_acquired"}));
        return Ok(75);
    };
    let token = lock.fencing_token();
    emit(json!({"event": "acquired", "token": token, "pid": std::process::id()}));
    let lost = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (lost, fired) = (lock.lost(), lost.clone());
        tokio::spawn(async move {
            let reason = lost.await;
            emit(json!({"event": "lost", "reason": reason.to_string()}));
            fired.store(true, Ordering::SeqCst);
        })
    };
    let (mut seq, mut after_lost) = (0u64, 0u64);
    loop {
        if opts.writes.is_some_and(|n| seq >= n) {
            break;
        }
        if lost.load(Ordering::SeqCst) {
            if after_lost >= opts.writes_after_lost {
                break;
            }
            after_lost += 1;
        }
        let payload = format!("{}:{seq}", client.client_id());
        let outcome = write(&store, name, token, payload).await?;
        emit(write_event(token, seq, outcome));
        seq += 1;
        tokio::time::sleep(opts.interval).await;
    }
    watcher.abort();
    if lost.load(Ordering::SeqCst) {
        return Ok(79);
    }
    lock.release().await?;
    emit(json!({"event": "released"}));
    Ok(0)
}

async fn child(db: &std::path::Path, interval: Duration) -> Res<u8> {
    let token: u64 = std::env::var("LOCKROUTER_FENCING_TOKEN")?.parse()?;
    let name = std::env::var("LOCKROUTER_LOCK_NAME")?;
    let store = Arc::new(Mutex::new(FencedStore::open(db)?));
    emit(json!({"event": "start", "token": token, "pid": std::process::id()}));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    for seq in 0.. {
        let outcome = write(&store, &name, token, format!("child:{seq}")).await?;
        emit(write_event(token, seq, outcome));
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = term.recv() => break,
        }
    }
    emit(json!({"event": "stopped"}));
    Ok(143)
}

/// SQLite calls block (they may wait on another process's write lock), so
/// they run off the async threads.
async fn write(
    store: &Arc<Mutex<FencedStore>>,
    name: &str,
    token: u64,
    payload: String,
) -> Res<Write> {
    let (store, name) = (store.clone(), name.to_string());
    let outcome = tokio::task::spawn_blocking(move || {
        let mut store = store.lock().map_err(|_| "store mutex poisoned")?;
        store
            .write(&name, token, &payload)
            .map_err(|e| e.to_string())
    })
    .await??;
    Ok(outcome)
}

fn write_event(token: u64, seq: u64, outcome: Write) -> serde_json::Value {
    match outcome {
        Write::Accepted => json!({"event": "write", "token": token, "seq": seq, "accepted": true}),
        Write::Rejected { highest } => json!({
            "event": "write", "token": token, "seq": seq, "accepted": false, "highest": highest,
        }),
    }
}
