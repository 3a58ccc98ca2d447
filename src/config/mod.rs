//! Settings: a TOML file, then `LOCKROUTER__SECTION__KEY` environment
//! overrides, deserialised into typed structs and validated before anything
//! starts. Unknown keys are rejected so that a typo never silently falls back
//! to a default. This module touches nothing but the file system and the
//! environment.
//!
//! One file per section, each with its settings, their defaults, the
//! durations they give (callers never convert milliseconds themselves) and
//! their validation: [`server`], [`etcd`], [`limits`], [`admin`],
//! [`auth`], [`locks`], [`shards`] (with `[ring]`). [`secret`] holds the
//! values never shown (the admin token, lockId keys, passwords read from
//! files); [`validate`] the error and the rules sections share; [`keys`]
//! reads every key off the settings types.

use std::path::Path;

use serde::Deserialize;

mod admin;
mod auth;
mod etcd;
pub mod keys;
mod limits;
mod locks;
mod secret;
mod server;
mod shards;
mod validate;

pub use admin::AdminSettings;
pub use auth::{AuthSettings, LockIdKey, LockIdSecret, PrincipalSettings};
pub use etcd::EtcdSettings;
pub use limits::Limits;
pub use locks::{LockDelay, LockSettings};
pub use secret::Secret;
pub use server::{HttpTimeouts, ServerSettings};
pub use shards::{RingSettings, ShardSettings};
use validate::invalid;
pub use validate::ConfigError;

/// Everything the router needs to start.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Where and how the HTTP API is served.
    pub server: ServerSettings,
    /// How the router talks to every shard.
    #[serde(default)]
    pub etcd: EtcdSettings,
    /// What decides placement of names on shards (part of the ring fingerprint).
    #[serde(default)]
    pub ring: RingSettings,
    /// Input limits of the v1 API.
    #[serde(default)]
    pub limits: Limits,
    /// Who may call `/admin/v1/*`.
    #[serde(default)]
    pub admin: AdminSettings,
    /// Who may call the lock API, and the keys lockIds are sealed with.
    #[serde(default)]
    pub auth: AuthSettings,
    /// How locks behave beyond the API's limits.
    #[serde(default)]
    pub locks: LockSettings,
    /// The etcd clusters lock names are spread over.
    #[serde(default)]
    pub shards: Vec<ShardSettings>,
}

impl Settings {
    /// Reads `path` (TOML), applies `LOCKROUTER__SECTION__KEY` overrides and
    /// validates the result.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        if !path.is_file() {
            return Err(invalid(format!(
                "config file {} does not exist",
                path.display()
            )));
        }
        check_env_keys(std::env::vars_os().map(|(k, _)| k))?;
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from(path).format(config::FileFormat::Toml))
            .add_source(
                config::Environment::with_prefix("LOCKROUTER")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()?
            .try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Every key a config may set, read off these types.
    pub fn keys() -> keys::Keys {
        keys::Keys::of::<Settings>()
    }

    /// Parses settings from a TOML string (no environment), then validates.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()?
            .try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Checks everything serde cannot: addresses, bounds, shard identity,
    /// section by section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.etcd.validate()?;
        self.ring.validate()?;
        self.limits.validate()?;
        self.admin.validate()?;
        self.auth.validate(&self.server, &self.limits)?;
        shards::validate(&self.shards)
    }
}

/// The prefix of the variables that override keys
/// (`LOCKROUTER__SERVER__LISTEN` sets `server.listen`).
const ENV_PREFIX: &str = "LOCKROUTER__";

/// Every `LOCKROUTER__…` variable among `names` must name a key.
fn check_env_keys(names: impl Iterator<Item = std::ffi::OsString>) -> Result<(), ConfigError> {
    let keys = Settings::keys();
    for name in names {
        let Some(var) = name.to_str() else { continue };
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let key = rest.to_lowercase().replace("__", ".");
        if keys.contains(&key) {
            continue;
        }
        let parent = key.rsplit_once('.').map_or("", |(p, _)| p);
        let array = keys
            .all()
            .iter()
            .find(|k| key.starts_with(&format!("{k}.")) && keys.is_array_of_tables(k));
        let known = if let Some(array) = array {
            format!("[[{array}]] entries are set in the config file only")
        } else if keys.contains(parent) {
            format!("[{parent}] takes {}", keys.children(parent).join(", "))
        } else {
            format!("the sections are {}", keys.children("").join(", "))
        };
        return Err(ConfigError::UnknownEnvKey {
            var: var.to_string(),
            key,
            known,
        });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const MINIMAL: &str = r#"
        [server]
        listen = "127.0.0.1:8080"
        [etcd]
        prefix = "/lockrouter"
        [[shards]]
        name = "a"
        endpoints = ["http://127.0.0.1:2379"]
    "#;

    /// Asserts that `text` is refused with a message naming `needle`.
    pub(super) fn rejects(text: &str, needle: &str) {
        let err = Settings::from_toml(text).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let s = Settings::from_toml(MINIMAL).unwrap();
        assert_eq!(s.shards[0].weight, 1);
        assert_eq!(s.limits.max_batch, 1_000);
        assert_eq!(s.etcd.request_timeout_ms, 3_000);
    }

    #[test]
    fn a_variable_naming_no_key_is_named_as_a_variable() {
        let vars = |names: &[&str]| {
            check_env_keys(names.iter().map(std::ffi::OsString::from)).map_err(|e| e.to_string())
        };
        assert!(vars(&[
            "LOCKROUTER__SERVER__MAX_IN_FLIGHT",
            "LOCKROUTER_URL",
            "PATH"
        ])
        .is_ok());
        let err = vars(&["LOCKROUTER__SERVER__LISTNE"]).unwrap_err();
        for needle in [
            "environment variable LOCKROUTER__SERVER__LISTNE",
            "server.listne",
            "from the environment",
            "[server] takes listen,",
        ] {
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
        let err = vars(&["LOCKROUTER__SERVR__LISTEN"]).unwrap_err();
        assert!(err.contains("the sections are server, etcd"), "{err}");
        let err = vars(&["LOCKROUTER__SHARDS__0__NAME"]).unwrap_err();
        assert!(
            err.contains("[[shards]] entries are set in the config file only"),
            "{err}"
        );
    }

    #[test]
    fn settings_give_their_durations() {
        let s = Settings::from_toml(&format!(
            "{}\n[admin]\nreload_poll_ms = 0\n[limits]\nmax_wait_ms = 1500\n",
            MINIMAL.replace(
                "[server]\n",
                "[server]\nshutdown_grace_ms = 250\nbody_read_timeout_ms = 300\n"
            )
        ))
        .unwrap();
        let ms = std::time::Duration::from_millis;
        assert_eq!(s.server.shutdown_grace(), ms(250));
        assert_eq!(s.server.timeouts().body_read, ms(300));
        assert_eq!(s.server.timeouts().header_read, ms(10_000));
        assert_eq!(s.server.renewal_budget(), ms(500));
        assert_eq!(s.etcd.request_timeout(), ms(3_000));
        assert_eq!(s.etcd.keepalive_burst(), ms(20));
        assert_eq!(s.limits.max_wait(), ms(1_500));
        assert_eq!(s.admin.reload_poll(), None, "0: never polled");
        let polled = Settings::from_toml(MINIMAL).unwrap();
        assert_eq!(polled.admin.reload_poll(), Some(ms(2_000)));
    }

    #[test]
    fn bad_configs_name_the_problem() {
        rejects(&MINIMAL.replace("prefix", "prefx"), "prefx");
        rejects(
            r#"[server]
            listen = "127.0.0.1:8080""#,
            "no shards",
        );
        rejects(
            &MINIMAL.replace("127.0.0.1:8080", "nowhere"),
            "server.listen",
        );
        rejects(
            &format!("{MINIMAL}\n[[shards]]\nname = \"a\"\nendpoints = [\"http://h:1\"]"),
            "duplicate",
        );
        rejects(
            &MINIMAL.replace("[\"http://127.0.0.1:2379\"]", "[]"),
            "no endpoints",
        );
        rejects(
            &MINIMAL.replace("http://127.0.0.1:2379", "127.0.0.1:2379"),
            "endpoint",
        );
        rejects(
            &format!("{MINIMAL}\n[limits]\nmin_ttl_ms = 1000"),
            "min_ttl_ms",
        );
        for streams in [0, 17] {
            let text = MINIMAL.replace(
                "prefix = \"/lockrouter\"",
                &format!("prefix = \"/lockrouter\"\nkeepalive_streams = {streams}"),
            );
            rejects(&text, "etcd.keepalive_streams");
        }
        let four = MINIMAL.replace(
            "prefix = \"/lockrouter\"",
            "prefix = \"/lockrouter\"\nkeepalive_streams = 4",
        );
        assert_eq!(
            Settings::from_toml(&four).unwrap().etcd.keepalive_streams,
            4
        );
        assert_eq!(
            Settings::from_toml(MINIMAL).unwrap().etcd.keepalive_streams,
            1
        );
        use std::time;
        let spacing = |ms: &str| {
            MINIMAL.replace(
                "prefix = \"/lockrouter\"",
                &format!("prefix = \"/lockrouter\"\nbarrier_spacing_ms = {ms}"),
            )
        };
        rejects(&spacing("251"), "etcd.barrier_spacing_ms");
        rejects(&spacing("-1"), "barrier_spacing_ms");
        for (ms, expected) in [("0", 0), ("250", 250)] {
            let etcd = Settings::from_toml(&spacing(ms)).unwrap().etcd;
            assert_eq!(
                etcd.barrier_spacing(),
                time::Duration::from_millis(expected)
            );
        }
        assert_eq!(
            Settings::from_toml(MINIMAL).unwrap().etcd.barrier_spacing(),
            time::Duration::from_millis(50)
        );
    }
}
