//! What the kernel says about a process, from `/proc`: resident memory,
//! CPU time, whether every thread is stopped, and the whole machine's busy
//! time. Each reading is `None` (or 0) when the process is gone or the file
//! cannot be read: callers sample, they do not depend on one reading.

use std::path::Path;

/// Resident set size of `pid` now, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:").map(|k| k * 1024)
}

/// Peak resident set size of `pid` since it started or since the last
/// [`reset_peak_rss`], in bytes.
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:").map(|k| k * 1024)
}

/// Resets the kernel's peak-RSS mark of `pid` (writing 5 to `clear_refs`),
/// so a phase's peak is its own. Fails quietly where that is not
/// permitted: sample [`rss_bytes`] too.
pub fn reset_peak_rss(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// CPU time (user + system, all threads) `pid` has used, in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces: utime and stime
    // are fields 14 and 15 of the whole line.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / ticks_per_second())
}

/// Context switches, voluntary or not, of every live thread of `pid` so
/// far: how often it was put to sleep or preempted, one wake-up each.
pub fn context_switches(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.filter_map(Result::ok) {
        // A thread that ended meanwhile takes its count with it.
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        total += switches_in(&status)?;
    }
    Some(total)
}

/// The context switches one thread's `status` file counts.
fn switches_in(status: &str) -> Option<u64> {
    let mut total = 0;
    for line in status.lines() {
        if let Some(n) = line
            .strip_prefix("voluntary_ctxt_switches:")
            .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
        {
            total += n.trim().parse::<u64>().ok()?;
        }
    }
    Some(total)
}

/// Busy CPU seconds of the whole machine, from the first line of
/// `/proc/stat` (0 if it cannot be read).
pub fn machine_busy_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(cpu) = stat.lines().next() else {
        return 0.0;
    };
    let ticks: Vec<f64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...: idle and iowait
    // are not busy; guest time is already inside user.
    let busy: f64 = ticks
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, t)| t)
        .sum();
    busy / ticks_per_second()
}

/// The kernel's clock ticks per second, the unit of `/proc`'s CPU times.
fn ticks_per_second() -> f64 {
    use nix::unistd::{sysconf, SysconfVar};
    match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(hz)) if hz > 0 => hz as f64,
        _ => 1.0,
    }
}

/// True if every thread of `pid` is in state `T` (stopped by a signal).
/// A SIGSTOP is delivered asynchronously, thread by thread: poll this to
/// know it has taken effect.
pub fn threads_stopped(pid: u32) -> bool {
    let tasks = format!("/proc/{pid}/task");
    let Ok(entries) = std::fs::read_dir(Path::new(&tasks)) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sleeping_thread_counts_its_context_switches() {
        // This thread's own count: the process's total also loses the
        // counts of other tests' threads as they end.
        let mine = || {
            let status = std::fs::read_to_string("/proc/thread-self/status").expect("status");
            switches_in(&status).expect("both counts")
        };
        let before = mine();
        for _ in 0..5 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let after = mine();
        assert!(after >= before + 5, "{before} then {after}");
        assert!(context_switches(std::process::id()).is_some_and(|n| n >= after));
        assert_eq!(context_switches(u32::MAX), None, "no such process");
    }
}
