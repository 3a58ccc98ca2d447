//! The processes a benchmark runs against: single-node etcd clusters, one
//! per shard, and the `lockrouter` binary, started with lockrouter-testkit
//! on free loopback ports with their data on tmpfs when there is one (the
//! benchmark measures CPU cost, not the disk this machine happens to have;
//! see docs/benchmarks.md). Every process is killed and reaped when the
//! [`Stack`] drops, and by the kernel if this process is killed outright, so
//! a failed or interrupted run leaves nothing behind. The router may serve
//! only some of the shards, and its config file can be rewritten to list
//! all of them and reloaded (`rebalance`).

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use lockrouter_testkit::config::shards_toml;
use lockrouter_testkit::etcd::EtcdCluster;
use lockrouter_testkit::loopback::free_port;
use lockrouter_testkit::router_process::RouterProcess;

/// Flags for every etcd shard, after the kit's test timings.
const ETCD_FLAGS: &[&str] = &[
    // etcd's own raft timings, not the kit's shorter ones for tests: the
    // benchmark measures what a deployment runs.
    "--heartbeat-interval",
    "100",
    "--election-timeout",
    "1000",
    // A million lock keys and their history must fit: 8 GiB quota instead
    // of the 2 GiB default (the data lives in memory anyway).
    "--quota-backend-bytes",
    "8589934592",
];

/// How long the router may take to reach every shard and record its ring.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// The shards and the router of one benchmark run.
pub struct Stack {
    /// Declared first, so it stops before the shards it talks to.
    pub router: RouterProcess,
    /// Named a, b, c, ... in the router's config.
    pub shards: Vec<EtcdCluster>,
}

impl Stack {
    /// `shards` single-node etcd clusters named a, b, c, ... and a router.
    pub fn start(router_bin: &Path, shards: usize) -> Result<Self> {
        Self::start_partial(router_bin, shards, shards)
    }

    /// `shards` etcd clusters, and a router whose config lists only the
    /// first `routed` of them.
    pub fn start_partial(router_bin: &Path, shards: usize, routed: usize) -> Result<Self> {
        let shards = (0..shards)
            .map(|_| {
                EtcdCluster::builder(1)
                    .args(ETCD_FLAGS)
                    .die_with_parent()
                    .start()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let port = free_port();
        let router = RouterProcess::builder()
            .binary(router_bin)
            .env("RUST_LOG", "warn")
            .die_with_parent()
            .spawn(
                &config_toml(port, &shards[..routed.min(shards.len())]),
                port,
            )?;
        router.wait_ready(READY_WITHIN)?;
        Ok(Self { router, shards })
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.shards
            .iter()
            .flat_map(EtcdCluster::endpoints)
            .collect()
    }

    /// Rewrites the router's config to list every shard (it takes effect
    /// on reload).
    pub fn route_all_shards(&self) -> Result<()> {
        let toml = config_toml(self.router.port, &self.shards);
        Ok(self.router.rewrite_config(&toml)?)
    }
}

/// The router's config: its port and `shards`. The file is not polled for
/// changes: only `POST /admin/v1/reload` reloads it, so a benchmark knows
/// the moment a reload starts.
fn config_toml(port: u16, shards: &[EtcdCluster]) -> String {
    let header = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\n\n[etcd]\nprefix = \"/lockrouter\"\n\n[admin]\nreload_poll_ms = 0\n"
    );
    header + &shards_toml(&shards.iter().collect::<Vec<_>>())
}
