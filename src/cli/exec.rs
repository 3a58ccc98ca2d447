//! `lockrouter exec`: run a command while holding a lock, for cron jobs and
//! scripts ("only one worker runs tonight's batch").
//!
//! It acquires the lock through the client SDK (which renews it in the
//! background), starts the command with the lock's name, id and fencing
//! token in its environment, and waits. If the lock is lost, the command
//! gets SIGTERM, then SIGKILL after a grace period. SIGTERM, SIGHUP,
//! SIGQUIT, SIGUSR1 and SIGUSR2 sent to `exec` are passed on to the
//! command, and so is SIGINT unless `exec` runs at a terminal (there Ctrl-C
//! already reaches the command, which stays in `exec`'s process group for
//! job control). If `exec` itself dies (even by SIGKILL), the kernel kills
//! the command (`PR_SET_PDEATHSIG`): a command must not run on without the
//! lock that `exec` no longer renews. When the command exits the lock is
//! released. A `--wait` longer than the router's longest wait is split
//! into waits the router accepts, each queuing again. The router is found
//! through the connection flags every command shares ([`Target`]). Exit
//! codes are listed in [`codes`] (and for `--help` in [`EXIT_CODES`]).

use std::io::IsTerminal;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use lockrouter_client::{Client, Error, Lock};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal as UnixSignal, SignalKind};

use super::target::Target;

/// Exit codes of `lockrouter exec` besides the command's own.
pub mod codes {
    /// The command could not be started, or `exec` itself failed (EX_SOFTWARE).
    pub const INTERNAL: u8 = 70;
    /// The router could not be reached or is unavailable (EX_UNAVAILABLE).
    pub const UNAVAILABLE: u8 = 69;
    /// The router refused the acquire as malformed, e.g. a TTL outside its
    /// limits (a 4xx other than 429) (EX_USAGE).
    pub const REFUSED: u8 = 64;
    /// The router refused the caller's credentials or its principal may not
    /// take the name (401, 403) (EX_NOPERM).
    pub const NOPERM: u8 = 77;
    /// Someone else holds the lock (after `--wait`, if given) (EX_TEMPFAIL).
    pub const NOT_ACQUIRED: u8 = 75;
    /// The lock was lost while the command ran; the command was stopped.
    pub const LOST: u8 = 79;
    /// Bad arguments, such as a malformed router URL (as clap's own errors).
    pub const USAGE: u8 = 2;
    /// The command was not found (as in shells).
    pub const NOT_FOUND: u8 = 127;
    /// The command could not be executed (as in shells).
    pub const NOT_EXECUTABLE: u8 = 126;
}

/// `--help`'s account of [`codes`].
pub const EXIT_CODES: &str = "\
Exit codes:
  the command's own   it ran and exited; the lock was released
  128 + N             it was ended by signal N
  75   someone else holds the lock (after --wait, if given); nothing ran
  79   the lock was lost while the command ran; the command was stopped
  64   the router refused the acquire as malformed (e.g. a TTL outside
       its limits)
  77   the router refused the credentials, or the name (401, 403)
  69   the router is unavailable (5xx, 429) or cannot be reached
  70   exec itself failed
  2    bad arguments, such as a malformed URL
  126  the command could not be executed; 127: it was not found";

/// Arguments of `lockrouter exec`.
#[derive(clap::Args, Debug, Clone)]
pub struct ExecArgs {
    #[command(flatten)]
    pub target: Target,
    /// The lock's name.
    #[arg(long)]
    pub name: String,
    /// The lock's TTL (e.g. 30s, 2m); renewed every third of it.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// Wait this long for the lock if it is held, queued first come, first
    /// served at the router (at most its limits.max_wait_ms, 60 s by
    /// default). Default: do not wait.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s")]
    pub wait: Duration,
    /// The client id to acquire under. Default: a random one.
    #[arg(long)]
    pub client_id: Option<String>,
    /// After SIGTERM to the command on a lost lock, wait this long before
    /// SIGKILL.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub grace: Duration,
    /// The command and its arguments (after `--`).
    #[arg(required = true, last = true)]
    pub command: Vec<String>,
}

/// Runs `lockrouter exec` to completion and returns its exit code.
pub fn main(args: ExecArgs) -> u8 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockrouter exec: cannot start the runtime: {e}");
            return codes::INTERNAL;
        }
    };
    runtime.block_on(run(args))
}

async fn run(args: ExecArgs) -> u8 {
    let target = &args.target;
    let mut builder = Client::builder(&target.url);
    if let Some(id) = &args.client_id {
        builder = builder.client_id(id.clone());
    }
    if let Some(token) = &target.token {
        builder = builder.bearer_token(token.clone());
    }
    match target.ca_pem() {
        Ok(Some(pem)) => builder = builder.ca_pem(pem),
        Ok(None) => {}
        Err(e) => {
            eprintln!("lockrouter exec: {e}");
            return codes::USAGE;
        }
    }
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockrouter exec: {e}");
            return codes::USAGE;
        }
    };
    let acquired = acquire(&client, &args).await;
    let lock = match acquired {
        Ok(Some(lock)) => lock,
        Ok(None) => {
            eprintln!(
                "lockrouter exec: lock {:?} is held by another client",
                args.name
            );
            return codes::NOT_ACQUIRED;
        }
        Err(e) => {
            eprintln!("lockrouter exec: cannot acquire {:?}: {e}", args.name);
            return match e {
                Error::Router {
                    status: 401 | 403, ..
                } => codes::NOPERM,
                Error::Router { status, .. } if (400..500).contains(&status) && status != 429 => {
                    codes::REFUSED
                }
                _ => codes::UNAVAILABLE,
            };
        }
    };
    // Handlers first, so a signal arriving right after the command starts
    // is forwarded rather than killing exec and orphaning the command.
    let signals = match Signals::new() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lockrouter exec: cannot handle signals: {e}");
            release(lock).await;
            return codes::INTERNAL;
        }
    };
    let child = match spawn(&args.command, &lock) {
        Ok(child) => child,
        Err((code, msg)) => {
            eprintln!("lockrouter exec: {msg}");
            release(lock).await;
            return code;
        }
    };
    supervise(child, lock, args.grace, signals).await
}

/// The longest wait asked of the router at once: below its default
/// `limits.max_wait_ms` (60 s). A longer `--wait` queues again after each.
const WAIT_CHUNK: Duration = Duration::from_secs(30);

/// Acquires, waiting up to `--wait` in waits the router accepts: a router
/// whose `limits.max_wait_ms` is below the chunk refuses it as too long
/// (400 naming waitMs), and the chunk is halved until it is accepted.
async fn acquire(client: &Client, args: &ExecArgs) -> Result<Option<Lock>, Error> {
    let until = tokio::time::Instant::now() + args.wait;
    let mut chunk = WAIT_CHUNK;
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        match client
            .acquire_wait(&args.name, args.ttl, left.min(chunk))
            .await
        {
            Ok(None) if !left.is_zero() && left > chunk => continue,
            Err(Error::Router {
                status: 400,
                ref message,
                ..
            }) if message.contains("waitMs") && chunk > Duration::from_secs(1) => {
                chunk /= 2;
            }
            other => return other,
        }
    }
}

/// The signals exec passes on to the command.
struct Signals {
    term: UnixSignal,
    int: UnixSignal,
    /// SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2: passed on as they come.
    others: Vec<(Signal, UnixSignal)>,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        let mut others = Vec::new();
        for (sig, kind) in [
            (Signal::SIGHUP, SignalKind::hangup()),
            (Signal::SIGQUIT, SignalKind::quit()),
            (Signal::SIGUSR1, SignalKind::user_defined1()),
            (Signal::SIGUSR2, SignalKind::user_defined2()),
        ] {
            others.push((sig, signal(kind)?));
        }
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            others,
        })
    }
}

/// The next of `others` to arrive.
async fn next_other(others: &mut [(Signal, UnixSignal)]) -> Signal {
    let waits = others.iter_mut().map(|(sig, s)| {
        let sig = *sig;
        Box::pin(async move {
            s.recv().await;
            sig
        })
    });
    futures::future::select_all(waits).await.0
}

fn spawn(command: &[String], lock: &Lock) -> Result<Child, (u8, String)> {
    let (program, rest) = command
        .split_first()
        .ok_or((codes::INTERNAL, "no command given".to_string()))?;
    let mut cmd = Command::new(program);
    cmd.args(rest)
        .env("LOCKROUTER_FENCING_TOKEN", lock.fencing_token().to_string())
        .env("LOCKROUTER_LOCK_NAME", lock.name())
        .env("LOCKROUTER_LOCK_ID", lock.lock_id())
        .stdin(Stdio::inherit())
        .kill_on_drop(true);
    // SAFETY: between fork and exec only async-signal-safe calls are
    // allowed; prctl is one. The runtime is single-threaded, so the thread
    // that forks (whose death the signal follows) lives as long as exec.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
    cmd.spawn().map_err(|e| {
        let code = match e.kind() {
            std::io::ErrorKind::NotFound => codes::NOT_FOUND,
            std::io::ErrorKind::PermissionDenied => codes::NOT_EXECUTABLE,
            _ => codes::INTERNAL,
        };
        (code, format!("cannot run {program:?}: {e}"))
    })
}

/// Waits for the command, stopping it if the lock is lost and passing
/// SIGINT/SIGTERM on to it; returns the exit code.
async fn supervise(mut child: Child, lock: Lock, grace: Duration, mut sig: Signals) -> u8 {
    // The command shares exec's process group, so a Ctrl-C at a terminal
    // already reaches it; forwarding that SIGINT too would deliver it twice.
    let interactive = std::io::stdin().is_terminal();
    let lost = lock.lost();
    tokio::pin!(lost);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            reason = &mut lost => {
                eprintln!(
                    "lockrouter exec: lock {:?} lost ({reason}); stopping the command",
                    lock.name()
                );
                stop(&mut child, grace).await;
                release(lock).await;
                return codes::LOST;
            }
            _ = sig.term.recv() => forward(&child, Signal::SIGTERM),
            _ = sig.int.recv() => if !interactive {
                forward(&child, Signal::SIGINT)
            },
            other = next_other(&mut sig.others) => forward(&child, other),
        }
    };
    release(lock).await;
    match status {
        Ok(status) => exit_code(status),
        Err(e) => {
            eprintln!("lockrouter exec: lost track of the command: {e}");
            codes::INTERNAL
        }
    }
}

fn forward(child: &Child, sig: Signal) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = kill(Pid::from_raw(pid), sig);
    }
}

/// SIGTERM, then SIGKILL if the command is still running after `grace`.
async fn stop(child: &mut Child, grace: Duration) {
    forward(child, Signal::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
}

/// Releases the lock, bounded: the command is done either way. An
/// unreleased lock goes with its session lease once nothing renews it: within
/// its TTL after this process exits, unless other processes with the same
/// client id keep locks of that TTL on that shard alive.
async fn release(lock: Lock) {
    let name = lock.name().to_string();
    match tokio::time::timeout(Duration::from_secs(10), lock.release()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            eprintln!("lockrouter exec: release of {name:?} failed ({e}); it is freed when its session lease ends")
        }
        Err(_) => {
            eprintln!("lockrouter exec: release of {name:?} timed out; it is freed when its session lease ends")
        }
    }
}

/// The command's exit code, or 128 + signal number if a signal ended it.
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(sig)) => 128u8.saturating_add(sig as u8),
        _ => codes::INTERNAL,
    }
}
