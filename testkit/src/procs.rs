//! Separate processes for client-side tests (the `fenced_worker` example,
//! `lockrouter exec`): each [`Proc`] is killed and reaped on drop, and its
//! JSON-line stdout is collected by a thread so a test can wait for an event
//! (bounded) while the process runs. [`crate::bins`] finds the programs.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;

use crate::procfs::threads_stopped;

/// A child process whose stdout is read as JSON lines (other lines are
/// kept as strings).
pub struct Proc {
    /// The process: tests signal it and wait for it.
    pub child: Child,
    /// Lines parsed by the reader thread, in order.
    events: mpsc::Receiver<Value>,
    /// Every event seen so far, for assertions and failure messages.
    pub seen: Vec<Value>,
    /// Names it in failure messages.
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
        let deadline = Instant::now() + Duration::from_secs(10);
        while !threads_stopped(self.child.id()) {
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

/// Predicate: an event named `name`.
pub fn is(name: &'static str) -> impl Fn(&Value) -> bool {
    move |v| v["event"] == name
}
