//! `[limits]`: the input limits of the v1 API (TTLs, name and clientId
//! sizes, batches, bodies, waits) and the bounds on waiters and on each
//! clientId's acquire rate.

use std::time::Duration;

use serde::Deserialize;

use super::validate::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    #[serde(default = "defaults::min_ttl_ms")]
    pub min_ttl_ms: u64,
    #[serde(default = "defaults::max_ttl_ms")]
    pub max_ttl_ms: u64,
    #[serde(default = "defaults::max_name_bytes")]
    pub max_name_bytes: usize,
    #[serde(default = "defaults::max_client_id_bytes")]
    pub max_client_id_bytes: usize,
    #[serde(default = "defaults::max_batch")]
    pub max_batch: usize,
    #[serde(default = "defaults::max_body_bytes")]
    pub max_body_bytes: usize,
    /// Longest `waitMs` an acquire may ask for.
    #[serde(default = "defaults::max_wait_ms")]
    pub max_wait_ms: u64,
    /// Waiting acquires a router holds at once; beyond it, 429 (read at start).
    #[serde(default = "defaults::max_waiters")]
    pub max_waiters: usize,
    /// Acquires one clientId may start per second (in bursts of as many);
    /// beyond it, 429. 0: no limit (read at start).
    #[serde(default = "defaults::acquires_per_client_per_sec")]
    pub acquires_per_client_per_sec: u32,
    /// Largest `metadata` an acquire may attach, as compact JSON.
    #[serde(default = "defaults::max_metadata_bytes")]
    pub max_metadata_bytes: usize,
}

impl Limits {
    /// The longest wait an acquire may ask for.
    pub fn max_wait(&self) -> Duration {
        Duration::from_millis(self.max_wait_ms)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        // etcd's minimum lease TTL is 2 s and leases are whole seconds.
        if self.min_ttl_ms < 2_000 || self.min_ttl_ms > self.max_ttl_ms {
            return Err(invalid(format!(
                "limits.min_ttl_ms = {} must be >= 2000 and <= limits.max_ttl_ms = {}",
                self.min_ttl_ms, self.max_ttl_ms
            )));
        }
        if self.max_ttl_ms > 86_400_000 {
            return Err(invalid("limits.max_ttl_ms must be <= 86400000 (one day)"));
        }
        if self.max_name_bytes == 0 || self.max_client_id_bytes == 0 || self.max_batch == 0 {
            return Err(invalid(
                "limits.max_name_bytes, max_client_id_bytes and max_batch must be > 0",
            ));
        }
        if !(1..=600_000).contains(&self.max_wait_ms)
            || !(1..=1_000_000).contains(&self.max_waiters)
        {
            return Err(invalid(
                "limits.max_wait_ms must be 1..=600000 and limits.max_waiters 1..=1000000",
            ));
        }
        if self.max_metadata_bytes > 65_536 {
            return Err(invalid("limits.max_metadata_bytes must be at most 65536"));
        }
        if self.max_body_bytes < 1_024 {
            return Err(invalid("limits.max_body_bytes must be at least 1024"));
        }
        if self.acquires_per_client_per_sec > 1_000_000 {
            return Err(invalid(format!(
                "limits.acquires_per_client_per_sec = {} must be 0 (no limit) to 1000000",
                self.acquires_per_client_per_sec
            )));
        }
        Ok(())
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            min_ttl_ms: defaults::min_ttl_ms(),
            max_ttl_ms: defaults::max_ttl_ms(),
            max_name_bytes: defaults::max_name_bytes(),
            max_client_id_bytes: defaults::max_client_id_bytes(),
            max_batch: defaults::max_batch(),
            max_body_bytes: defaults::max_body_bytes(),
            max_wait_ms: defaults::max_wait_ms(),
            max_waiters: defaults::max_waiters(),
            acquires_per_client_per_sec: defaults::acquires_per_client_per_sec(),
            max_metadata_bytes: defaults::max_metadata_bytes(),
        }
    }
}

mod defaults {
    pub fn min_ttl_ms() -> u64 {
        2_000
    }
    pub fn max_ttl_ms() -> u64 {
        3_600_000
    }
    pub fn max_name_bytes() -> usize {
        512
    }
    pub fn max_client_id_bytes() -> usize {
        256
    }
    pub fn max_batch() -> usize {
        1_000
    }
    pub fn max_body_bytes() -> usize {
        1 << 20
    }
    pub fn max_wait_ms() -> u64 {
        60_000
    }
    pub fn max_waiters() -> usize {
        10_000
    }
    pub fn acquires_per_client_per_sec() -> u32 {
        1_000
    }
    pub fn max_metadata_bytes() -> usize {
        1_024
    }
}
