//! CPU placement of a run, set with `taskset` (util-linux): for the pinned
//! table, etcd gets the first CPU this process may use and the router and
//! the load generator get the others, so etcd's raft work no longer competes
//! with them for a core. What each process really got is read back from the
//! kernel (`Cpus_allowed_list` in `/proc/PID/status`), never assumed.
//!
//! A child inherits the CPU set of the thread that starts it, so etcd and
//! the router are started from this process's main thread while that
//! thread is pinned where they belong: etcd sizes its Go scheduler (and the
//! router its worker threads) from the CPUs it starts with. A child found
//! elsewhere is moved with `taskset -a` (every thread) after the fact.

use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// Which CPUs (kernel list syntax, e.g. `0` or `1-3`) each part of a run got.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Placement {
    pub etcd: String,
    pub router: String,
    pub loadgen: String,
}

/// A split of this machine's CPUs between etcd, the router and the load
/// generator, or why it cannot have one.
#[derive(Debug, Clone)]
pub struct Split {
    /// This process's CPUs before pinning, to restore afterwards.
    pub all: String,
    pub etcd: String,
    pub router: String,
    pub loadgen: String,
}

impl Split {
    /// The pinned table's: etcd on the first CPU this process may use, the
    /// router and the load generator on the others; `Err` says why the
    /// machine cannot be split (fewer than 2 CPUs, or no usable taskset).
    pub fn plan() -> std::result::Result<Self, String> {
        let (all, cpus) = usable()?;
        let rest = join(&cpus[1..]);
        Ok(Self {
            all,
            etcd: cpus[0].to_string(),
            router: rest.clone(),
            loadgen: rest,
        })
    }

    /// `overload-pinned`'s: the load generator on the last CPU this process
    /// may use, etcd and the router on the others, so that what the router
    /// admits does not wait for the generator's CPU.
    pub fn loadgen_apart() -> std::result::Result<Self, String> {
        let (all, cpus) = usable()?;
        let (last, others) = cpus.split_last().expect("at least 2 CPUs");
        let others = join(others);
        Ok(Self {
            all,
            etcd: others.clone(),
            router: others,
            loadgen: last.to_string(),
        })
    }
}

/// This process's CPUs, listed and expanded, if there are at least two
/// and taskset works.
fn usable() -> std::result::Result<(String, Vec<u32>), String> {
    let all = cpus_allowed(std::process::id())
        .ok_or("cannot read this process's CPUs from /proc/self/status")?;
    let cpus = expand(&all);
    if cpus.len() < 2 {
        return Err(format!(
            "this process may use {} CPU ({all}); the split needs 2",
            cpus.len()
        ));
    }
    if let Err(e) = taskset(&["-p", &std::process::id().to_string()]) {
        return Err(format!("taskset (util-linux) is not usable: {e:#}"));
    }
    Ok((all, cpus))
}

/// The CPUs `pid` may run on, as the kernel lists them.
pub fn cpus_allowed(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list:"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// Pins thread `tid` (a process's main thread when `tid` is its pid) to
/// `cpus`; with `all_threads`, every thread of process `tid`.
pub fn pin(tid: u32, cpus: &str, all_threads: bool) -> Result<()> {
    let tid = tid.to_string();
    let mut args = Vec::new();
    if all_threads {
        args.push("-a");
    }
    args.extend(["-p", "-c", cpus, &tid]);
    taskset(&args)
}

/// Pins `pid` (every thread) to `cpus` unless the kernel already says so.
pub fn ensure(pid: u32, cpus: &str) -> Result<()> {
    if cpus_allowed(pid).is_some_and(|now| expand(&now) == expand(cpus)) {
        return Ok(());
    }
    pin(pid, cpus, true)
}

/// Puts every thread of this process back on `cpus` when dropped.
pub struct Restore {
    /// The CPU list this process had before it was pinned.
    pub cpus: String,
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(e) = pin(std::process::id(), &self.cpus, true) {
            eprintln!(
                "could not put the load generator back on CPUs {}: {e:#}",
                self.cpus
            );
        }
    }
}

fn taskset(args: &[&str]) -> Result<()> {
    let out = Command::new("taskset")
        .args(args)
        .output()
        .context("run taskset")?;
    if !out.status.success() {
        bail!(
            "taskset {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `0-2,5` as [0, 1, 2, 5].
fn expand(list: &str) -> Vec<u32> {
    list.split(',')
        .filter_map(|part| {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            Some(a.trim().parse::<u32>().ok()?..=b.trim().parse::<u32>().ok()?)
        })
        .flatten()
        .collect()
}

/// [1, 2, 3, 5] as `1,2,3,5` (taskset accepts any list).
fn join(cpus: &[u32]) -> String {
    cpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(expand("0-2,5"), vec![0, 1, 2, 5]);
        assert_eq!(expand("3"), vec![3]);
        assert_eq!(join(&[1, 2]), "1,2");
        assert!(cpus_allowed(std::process::id()).is_some());
    }
}
