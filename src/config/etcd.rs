//! `[etcd]`: how the router talks to every shard (the key prefix, the
//! deadlines, the probes' and counts' intervals, how keepalives coalesce),
//! and the durations they give.

use std::time::Duration;

use serde::Deserialize;

use super::validate::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdSettings {
    /// Key prefix used on every shard; lockrouter owns everything below it.
    #[serde(default = "defaults::prefix")]
    pub prefix: String,
    /// Deadline of one etcd request; past it the shard is reported unavailable.
    #[serde(default = "defaults::request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Deadline for opening a connection to an etcd endpoint.
    #[serde(default = "defaults::connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How often each shard is probed for health and ring state.
    #[serde(default = "defaults::health_interval_ms")]
    pub health_interval_ms: u64,
    /// Renewals of one lease within this window share one keepalive
    /// (capped at a tenth of the lease TTL).
    #[serde(default = "defaults::keepalive_coalesce_ms")]
    pub keepalive_coalesce_ms: u64,
    /// A session lease is sent a keepalive only when less than this
    /// percentage of its TTL is known to be left (100: at every renewal,
    /// coalesced as above); renewals in between are answered with the time
    /// the lease really has.
    #[serde(default = "defaults::keepalive_below_pct")]
    pub keepalive_below_pct: u8,
    /// Keepalive bursts on a shard's main stream are at least this many ms
    /// apart: a keepalive that finds none sent within it, or that an acquire
    /// waits on, goes at once; a renewal's else waits for the next burst
    /// with every other that comes meanwhile (one HTTP/2 frame, which etcd
    /// reads once); 0: each alone.
    #[serde(default = "defaults::keepalive_burst_ms")]
    pub keepalive_burst_ms: u64,
    /// Keepalive streams per shard, each lease always on the same one.
    /// etcd answers a stream's keepalives one at a time (and 3.4.31 and
    /// 3.5.13 on first may check the leader's leadership with a quorum
    /// before each), so more streams help where that loop is the limit.
    #[serde(default = "defaults::keepalive_streams")]
    pub keepalive_streams: usize,
    /// How often active locks per shard are counted (a count-only range).
    #[serde(default = "defaults::count_interval_ms")]
    pub count_interval_ms: u64,
    /// Least ms between two barriers of the lock-key cache on one shard
    /// (each a raft write that every renewal arriving meanwhile shares): a
    /// renewal that finds none sent within it gets one at once, others wait
    /// up to this long for the next. Caps barriers at 1000 / this per
    /// shard and replica, whatever the renewal rate; 0: one after another.
    #[serde(default = "defaults::barrier_spacing_ms")]
    pub barrier_spacing_ms: u64,
    /// While new sessions start on a shard, the leases of sessions gone
    /// idle with no lock on them are handed on to them, instead of lapsing
    /// (a revoke) while the new ones are granted (a grant each).
    #[serde(default = "defaults::hand_on_idle_sessions")]
    pub hand_on_idle_sessions: bool,
}

impl EtcdSettings {
    /// Deadline of one etcd request.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// Deadline for opening a connection to an etcd endpoint.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// How often each shard is probed.
    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }

    /// How often the lock keys on each shard are counted.
    pub fn count_interval(&self) -> Duration {
        Duration::from_millis(self.count_interval_ms)
    }

    /// Renewals of one lease this close share one keepalive.
    pub fn keepalive_coalesce(&self) -> Duration {
        Duration::from_millis(self.keepalive_coalesce_ms)
    }

    /// How long a burst of keepalives gathers (zero: each goes alone).
    pub fn keepalive_burst(&self) -> Duration {
        Duration::from_millis(self.keepalive_burst_ms)
    }

    /// Least time between two barriers of the lock-key cache on one shard.
    pub fn barrier_spacing(&self) -> Duration {
        Duration::from_millis(self.barrier_spacing_ms)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let p = &self.prefix;
        if p.is_empty() || p.ends_with('/') || p.chars().any(char::is_control) {
            return Err(invalid(format!(
                "etcd.prefix {p:?} must be non-empty, printable and not end with '/'"
            )));
        }
        for (key, v) in [
            ("etcd.request_timeout_ms", self.request_timeout_ms),
            ("etcd.connect_timeout_ms", self.connect_timeout_ms),
            ("etcd.health_interval_ms", self.health_interval_ms),
            ("etcd.count_interval_ms", self.count_interval_ms),
            (
                "etcd.keepalive_coalesce_ms",
                self.keepalive_coalesce_ms.max(10),
            ),
        ] {
            if !(10..=600_000).contains(&v) {
                return Err(invalid(format!("{key} = {v} must be 10..=600000")));
            }
        }
        // Below 40 %, a client renewing every third of its TTL could find
        // its lease with less than a third left and lose it before its
        // next renewal.
        if !(40..=100).contains(&self.keepalive_below_pct) {
            return Err(invalid(format!(
                "etcd.keepalive_below_pct = {} must be 40..=100",
                self.keepalive_below_pct
            )));
        }
        // A renewal waits up to this long for its barrier, and with the
        // shortest TTL allowed (2 s) renewals come every 667 ms.
        if self.barrier_spacing_ms > MAX_BARRIER_SPACING_MS {
            return Err(invalid(format!(
                "etcd.barrier_spacing_ms = {} must be 0..={MAX_BARRIER_SPACING_MS}",
                self.barrier_spacing_ms
            )));
        }
        if !(1..=MAX_KEEPALIVE_STREAMS).contains(&self.keepalive_streams) {
            return Err(invalid(format!(
                "etcd.keepalive_streams = {} must be 1..={MAX_KEEPALIVE_STREAMS}",
                self.keepalive_streams
            )));
        }
        Ok(())
    }
}

/// Most keepalive streams per shard: each is a gRPC stream etcd keeps and a
/// task in the router.
const MAX_KEEPALIVE_STREAMS: usize = 16;

/// Longest `etcd.barrier_spacing_ms`: a renewal may wait that much more.
const MAX_BARRIER_SPACING_MS: u64 = 250;

impl Default for EtcdSettings {
    fn default() -> Self {
        Self {
            prefix: defaults::prefix(),
            request_timeout_ms: defaults::request_timeout_ms(),
            connect_timeout_ms: defaults::connect_timeout_ms(),
            health_interval_ms: defaults::health_interval_ms(),
            keepalive_burst_ms: defaults::keepalive_burst_ms(),
            keepalive_streams: defaults::keepalive_streams(),
            keepalive_coalesce_ms: defaults::keepalive_coalesce_ms(),
            keepalive_below_pct: defaults::keepalive_below_pct(),
            count_interval_ms: defaults::count_interval_ms(),
            barrier_spacing_ms: defaults::barrier_spacing_ms(),
            hand_on_idle_sessions: defaults::hand_on_idle_sessions(),
        }
    }
}

mod defaults {
    pub fn prefix() -> String {
        "/lockrouter".into()
    }
    pub fn request_timeout_ms() -> u64 {
        3_000
    }
    pub fn connect_timeout_ms() -> u64 {
        1_000
    }
    pub fn health_interval_ms() -> u64 {
        1_000
    }
    pub fn keepalive_coalesce_ms() -> u64 {
        1_000
    }
    pub fn keepalive_burst_ms() -> u64 {
        20
    }
    pub fn barrier_spacing_ms() -> u64 {
        50
    }
    pub fn keepalive_streams() -> usize {
        1
    }
    pub fn keepalive_below_pct() -> u8 {
        50
    }
    pub fn count_interval_ms() -> u64 {
        10_000
    }
    pub fn hand_on_idle_sessions() -> bool {
        true
    }
}
