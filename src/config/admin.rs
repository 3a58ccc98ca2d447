//! `[admin]`: who may call `/admin/v1/*` (the admin token, the host names
//! admin requests may be addressed to) and how often the config file is
//! checked for changes.

use std::time::Duration;

use serde::Deserialize;

use super::secret::Secret;
use super::validate::{invalid, ConfigError};

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSettings {
    /// Bearer token admin calls must carry. Without one, admin routes
    /// answer only to clients on loopback addresses.
    #[serde(default)]
    pub token: Option<Secret>,
    /// How often the config file is checked for changes (0: never; SIGHUP
    /// and `POST /admin/v1/reload` still reload).
    #[serde(default = "defaults::reload_poll_ms")]
    pub reload_poll_ms: u64,
    /// Host names (besides loopback addresses and `localhost`) that admin
    /// requests may be addressed to while the admin routes are open to
    /// loopback clients: any other `Host` is refused, so that a web page
    /// that rebinds its own name to 127.0.0.1 cannot reach them.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
}

impl AdminSettings {
    /// How often the config file is checked for changes; `None`: never.
    pub fn reload_poll(&self) -> Option<Duration> {
        Some(Duration::from_millis(self.reload_poll_ms)).filter(|d| !d.is_zero())
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.token.as_ref().is_some_and(|t| t.expose().len() < 16) {
            return Err(invalid("admin.token must be at least 16 characters"));
        }
        Ok(())
    }
}

impl Default for AdminSettings {
    fn default() -> Self {
        Self {
            token: None,
            reload_poll_ms: defaults::reload_poll_ms(),
            allowed_hosts: Vec::new(),
        }
    }
}

mod defaults {
    pub fn reload_poll_ms() -> u64 {
        2_000
    }
}
