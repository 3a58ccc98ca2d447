//! One benchmark run: start the shards and the router, run the paired
//! rounds ([`paired`](crate::paired)) and then each other selected scenario
//! ([`single`](crate::single)) on [`Bench`]es; then the same paired rounds
//! on a stack with etcd on a CPU of its own; turn what was counted into
//! targets and checks, and write the summary ([`summary`]).

use anyhow::Result;
use serde_json::{json, Value};

use crate::bench::{Bench, PAIRED};
use crate::options::Config;
use crate::paired::Paired;
use crate::pinning::Split;
use crate::report::Record;
use crate::stack::Stack;
use crate::{checks, summary, targets};

impl Bench<'_> {
    /// The paired rounds (if any of their scenarios was selected), then
    /// every other selected scenario, on this bench's stack.
    pub async fn run(mut self) -> Result<(Option<Paired>, Vec<Record>)> {
        let c = self.cfg;
        let paired = if PAIRED.iter().any(|s| c.wants(s)) {
            Some(self.paired().await?)
        } else {
            None
        };
        if c.wants("barrier") {
            self.barrier().await?;
        }
        if c.wants("contended") {
            self.contended().await?;
        }
        if c.wants("contended-wait") {
            self.contended_wait().await?;
        }
        if c.wants("churn") {
            self.churn().await?;
        }
        if c.wants("hold") {
            self.hold_batch().await?;
        }
        if c.wants("per-lock-renew") {
            self.per_lock_renew().await?;
        }
        if c.wants("naive-hold") {
            self.naive_hold().await?;
        }
        if c.wants("rebalance") {
            self.rebalance().await?;
        }
        if c.wants("overload") {
            self.overload().await?;
        }
        if c.wants("overload-pinned") {
            self.overload_pinned().await?;
        }
        for r in &mut self.records {
            r.table = self.table.to_string();
        }
        Ok((paired, self.records))
    }
}

/// Runs the whole benchmark and writes its files; returns the problems
/// `--check` found (empty when it was not asked for).
pub async fn run_all(cfg: &Config) -> Result<Vec<String>> {
    std::fs::create_dir_all(&cfg.out)?;
    let mut paired = Vec::new();
    let stack = Stack::start(&cfg.router_bin, cfg.shards)?;
    eprintln!(
        "{} etcd shards and the router at {} are up; CPUs: etcd {}, router {}, load generator {}",
        stack.shards.len(),
        stack.router.api.base,
        stack.placement.etcd,
        stack.placement.router,
        stack.placement.loadgen
    );
    if cfg
        .etcd_go_env
        .iter()
        .any(|(k, _)| k == "ETCD_ENABLE_PPROF")
    {
        for url in stack.endpoints() {
            eprintln!("etcd pprof: {url}/debug/pprof/profile?seconds=20");
        }
    }
    // The router at rest first: what it costs per shard with nothing to do.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let at_rest = crate::idle::router_at_rest(
        &stack,
        std::time::Duration::from_secs(cfg.duration_s as u64),
    )
    .await;
    if let Some(r) = &at_rest {
        eprintln!(
            "   the router at rest: {:.1} context switches/s ({:.1} per shard), {:.4} cores",
            r.context_switches_per_s, r.context_switches_per_s_per_shard, r.cores
        );
    }
    let (shared, records) = match Bench::new(cfg, &stack, "shared").run().await {
        Ok(x) => x,
        Err(e) => {
            eprintln!("the router's log ends:\n{}", stack.router.log_tail());
            return Err(e);
        }
    };
    drop(stack);
    paired.extend(shared);
    if cfg.wants("pinned") {
        paired.push(pinned(cfg).await?);
    }

    let shared = paired.iter().find(|p| p.table == "shared");
    let targets = targets::targets(&records, shared, cfg);
    let mut every: Vec<Record> = paired.iter().flat_map(|p| p.legs.clone()).collect();
    every.extend(records.iter().cloned());
    let problems = if cfg.check {
        let mut problems = checks::check(&every);
        if at_rest.is_none() {
            problems
                .push("the router at rest: its CPU or context switches could not be read".into());
        }
        problems
    } else {
        Vec::new()
    };
    let summary = json!({
        "machine": machine(),
        "config": cfg,
        "paired": paired,
        "scenarios": records,
        "targets": targets,
        "router_at_rest": at_rest,
        "check_problems": problems,
    });
    summary::write(
        &cfg.out,
        &summary,
        &every,
        &paired,
        &targets,
        at_rest.as_ref(),
    )?;
    for t in &targets {
        eprintln!(
            "target {:<72} {:>10} {} {:<8} {}",
            t.name,
            t.measured,
            t.rule,
            t.limit,
            if t.met { "met" } else { "MISSED" }
        );
    }
    eprintln!("wrote {}", cfg.out.join("summary.json").display());
    Ok(problems)
}

/// The paired rounds again, with etcd on a CPU of its own, or why not.
async fn pinned(cfg: &Config) -> Result<Paired> {
    let split = match Split::plan() {
        Ok(s) => s,
        Err(why) => {
            eprintln!("== pinned: skipped: {why}");
            return Ok(Paired::skipped("pinned", cfg.fixed_rate, why));
        }
    };
    let stack = Stack::start_pinned(&cfg.router_bin, cfg.shards, &split)?;
    let p = &stack.placement;
    eprintln!(
        "== pinned: CPUs: etcd {}, router {}, load generator {}",
        p.etcd, p.router, p.loadgen
    );
    let mut bench = Bench::new(cfg, &stack, "pinned");
    match bench.paired().await {
        Ok(mut p) => {
            for r in &mut p.legs {
                r.table = "pinned".into();
            }
            Ok(p)
        }
        Err(e) => {
            eprintln!("the router's log ends:\n{}", stack.router.log_tail());
            Err(e)
        }
    }
}

/// What the numbers were measured on.
fn machine() -> Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    // The etcd the shards run (LOCKROUTER_ETCD_BIN, else the system's).
    let etcd = lockrouter_testkit::etcd::etcd_release()
        .map(|(_, version)| version)
        .unwrap_or_default();
    json!({"cores": cores, "memory_gib": mem_kib / (1 << 20), "cpu": cpu, "etcd": etcd})
}
