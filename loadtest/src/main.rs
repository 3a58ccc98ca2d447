//! `lockrouter-loadtest`: load tests and benchmarks lockrouter on this
//! machine. It starts its own etcd shards and router on loopback, runs goose
//! scenarios against the router and the same work straight against etcd,
//! accounts for every run from the servers' own metrics, and writes
//! `summary.json`, `summary.md` and goose's HTML reports.
//!
//! # Layout
//! - `options`: command line and the smoke/full sizes.
//! - `stack`: the etcd shards and the router of a run (processes of
//!   `lockrouter-testkit`, which also reads RSS and CPU time from `/proc`).
//! - `pinning`: which CPUs each process gets (`taskset`).
//! - `scrape`: the servers' metrics before and after each window.
//! - `idle`: leases revoked and etcd checked idle before each window.
//! - `stats`: what the load generator counts, HDR latency histograms.
//! - `api`: the router's v1 API as goose users call it.
//! - `attack`: running one goose attack.
//! - `scenarios`: uncontested, contended, contended-wait, churn, hold,
//!   per-lock-renew, rebalance, overload, the direct and naive
//!   baselines, client pools and the session warm-up.
//! - `bench`: the run; `paired`: the paired rounds of router and
//!   baselines; `single`: the scenarios that run once.
//! - `report`: records and files; `targets`: the targets; `checks`: what
//!   `--check` insists on; `compare`: earlier runs' targets side by side.

mod api;
mod attack;
mod bench;
mod checks;
mod compare;
mod idle;
mod options;
mod paired;
mod pinning;
mod report;
mod run;
mod scenarios;
mod scrape;
mod single;
mod stack;
mod stats;
mod summary;
mod targets;

use std::process::ExitCode;

use clap::Parser;

/// jemalloc, as the router: on shared cores the load generator's CPU per
/// request is taken from the servers it measures (docs/benchmarks.md).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = options::Cli::parse();
    if !cli.compare.is_empty() {
        return match compare::write(&cli.compare, &cli.out) {
            Ok(path) => {
                println!("wrote {}", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("lockrouter-loadtest: {e:#}");
                ExitCode::from(2)
            }
        };
    }
    let cfg = match cli.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockrouter-loadtest: {e:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockrouter-loadtest: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Every scenario is bounded in time; this bounds the whole run too.
    let limit = std::time::Duration::from_secs(cfg.max_minutes * 60);
    let run = async {
        match tokio::time::timeout(limit, run::run_all(&cfg)).await {
            Ok(result) => result,
            Err(_) => Err(anyhow::anyhow!("gave up after {} minutes", cfg.max_minutes)),
        }
    };
    match runtime.block_on(run) {
        Ok(problems) if problems.is_empty() => ExitCode::SUCCESS,
        Ok(problems) => {
            for p in problems {
                eprintln!("check failed: {p}");
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("lockrouter-loadtest: {e:#}");
            ExitCode::FAILURE
        }
    }
}
