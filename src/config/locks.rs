//! `[locks]`: how locks behave beyond the API's limits (the lock-delay of
//! a lost holder's name).

use serde::Deserialize;

#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct LockSettings {
    /// What happens to the name of a holder lost other than by release
    /// (its lease ended: the client died, or etcd revoked the lease early).
    #[serde(default)]
    pub lock_delay: LockDelay,
}

/// The lock-delay of a lost holder's name (see `docs/design.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LockDelay {
    /// The name is not granted again for one TTL of the lost lock after its
    /// key went: no grant overlaps any validity the lost holder was told
    /// of, even if etcd revoked its lease early.
    #[default]
    Ttl,
    /// The name is free as soon as the key is gone (as etcd leases alone
    /// would have it): only safe on etcd releases without the stale-leader
    /// lease revocation bug, and with resources that check fencing tokens.
    Off,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{rejects, MINIMAL};
    use crate::config::Settings;

    #[test]
    fn lock_delay_is_on_by_default_and_can_be_turned_off() {
        assert_eq!(
            Settings::from_toml(MINIMAL).unwrap().locks.lock_delay,
            LockDelay::Ttl
        );
        let off = format!("{MINIMAL}\n[locks]\nlock_delay = \"off\"");
        assert_eq!(
            Settings::from_toml(&off).unwrap().locks.lock_delay,
            LockDelay::Off
        );
        rejects(
            &format!("{MINIMAL}\n[locks]\nlock_delay = \"sometimes\""),
            "lock_delay",
        );
    }
}
