//! What every child process of the kit shares: its stderr goes to a log
//! file whose end is shown when it fails, readiness is polled within a
//! deadline, and a child can be made to die with its parent.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// How many lines of a log an error or a failure message shows.
pub const LOG_TAIL_LINES: usize = 30;

/// Makes the child die with this process even when this process is killed
/// outright and no destructor runs: the kernel sends it SIGKILL. The kernel
/// does so when the *thread* that started the child exits, so start such
/// children from a thread that outlives them (e.g. the main thread).
pub fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec; prctl is
    // async-signal-safe and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)
        });
    }
}

/// The last [`LOG_TAIL_LINES`] lines of the file at `path` (empty if it
/// cannot be read).
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

/// Polls `ready` every 50 ms until it holds or `within` has passed; whether
/// it held.
pub fn poll_until(within: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}
