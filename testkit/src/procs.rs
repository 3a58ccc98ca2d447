//! Separate processes for client-side tests: the `fenced_worker` example and
//! `lockrouter exec`, each killed and reaped on drop, with their JSON-line
//! stdout collected by a thread so a test can wait for an event (bounded)
//! while the process runs.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

/// The path of an example binary of this package, built now if it is
/// missing or older than its sources: `cargo test` builds examples only
/// when it builds every target, not for `--test tests` alone.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/tests-<hash> -> target/<profile>/examples/<name>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test binary lives in target/<profile>/deps");
    let path = profile_dir.join("examples").join(name);
    if is_stale(&path, name) {
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .args(["build", "--example", name, "--manifest-path"])
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
        if profile_dir.ends_with("release") {
            cargo.arg("--release");
        }
        let status = cargo.status().expect("run cargo build --example");
        assert!(status.success(), "cargo build --example {name} failed");
    }
    assert!(path.exists(), "example {name} not found at {path:?}");
    path
}

/// Missing, or older than a source it is built from (its own folder and
/// the client crate).
fn is_stale(binary: &Path, name: &str) -> bool {
    let Ok(built) = binary.metadata().and_then(|m| m.modified()) else {
        return true;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = [root.join("examples").join(name), root.join("client/src")];
    dirs.iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(|e| e.ok()?.metadata().ok()?.modified().ok())
        .any(|changed| changed > built)
}

/// The `lockrouter` binary.
pub fn lockrouter() -> PathBuf {
    env!("CARGO_BIN_EXE_lockrouter").into()
}

/// A child process whose stdout is read as JSON lines (other lines are
/// kept as strings).
pub struct Proc {
    pub child: Child,
    events: mpsc::Receiver<Value>,
    /// Every event seen so far, for assertions and failure messages.
    pub seen: Vec<Value>,
    label: String,
}

impl Proc {
    pub fn spawn(label: &str, mut cmd: Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {label}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let v = serde_json::from_str(&line).unwrap_or(Value::String(line));
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            events,
            seen: Vec::new(),
            label: label.to_string(),
        }
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    pub fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).unwrap_or_else(|e| panic!("{sig} to {}: {e}", self.label));
    }

    /// Waits (at most `within`) for an event matching `pred` and returns it;
    /// panics with everything seen so far if none comes.
    pub fn wait_for(&mut self, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        if let Some(v) = self.seen.iter().find(|v| pred(v)) {
            return v.clone();
        }
        self.receive_until(within, pred)
    }

    fn receive_until(&mut self, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(v) => {
                    self.seen.push(v.clone());
                    if pred(&v) {
                        return v;
                    }
                }
                Err(_) => panic!(
                    "{}: expected event not seen within {within:?}; seen: {:?}",
                    self.label, self.seen
                ),
            }
        }
    }

    /// Like [`wait_for`](Self::wait_for), but only for events not seen yet.
    pub fn wait_new(&mut self, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let from = self.seen.len();
        self.drain();
        if let Some(v) = self.seen[from..].iter().find(|v| pred(v)) {
            return v.clone();
        }
        self.receive_until(within, pred)
    }

    /// Stops the process with SIGSTOP and waits until the kernel reports
    /// every one of its threads stopped (the signal is delivered
    /// asynchronously, thread by thread).
    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
        let tasks = format!("/proc/{}/task", self.child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_stopped(Path::new(&tasks)) {
            assert!(Instant::now() < deadline, "{} did not stop", self.label);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Collects whatever events arrived so far without waiting.
    pub fn drain(&mut self) {
        while let Ok(v) = self.events.try_recv() {
            self.seen.push(v);
        }
    }

    /// Waits (at most `within`) for the process to exit; then drains its
    /// remaining output.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // The reader thread ends at EOF; give it a moment to hand over.
                while let Ok(v) = self.events.recv_timeout(Duration::from_secs(2)) {
                    self.seen.push(v);
                }
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {within:?}; seen: {:?}",
                self.label,
                self.seen
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// True if every thread under `/proc/<pid>/task` is in state `T`.
fn all_stopped(tasks: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(tasks) else {
        return false;
    };
    entries.filter_map(Result::ok).all(|task| {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // The state follows the parenthesised command name.
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        state == Some('T')
    })
}

/// Predicate: an event named `name`.
pub fn is(name: &'static str) -> impl Fn(&Value) -> bool {
    move |v| v["event"] == name
}
