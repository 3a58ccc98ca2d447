//! Settings: a TOML file, then `LOCKROUTER__SECTION__KEY` environment
//! overrides, deserialised into typed structs and validated before anything
//! starts. Unknown keys are rejected so that a typo never silently falls back
//! to a default. This module touches nothing but the file system.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

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
    /// How locks behave beyond the API's limits.
    #[serde(default)]
    pub locks: LockSettings,
    /// The etcd clusters lock names are spread over.
    #[serde(default)]
    pub shards: Vec<ShardSettings>,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Address of the main listener (API, health, metrics).
    pub listen: String,
    /// Optional second listener that serves only `/metrics`.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// PEM certificate chain for TLS on the main listener (with
    /// `tls_key_file`); without it the listener speaks plain HTTP. Read at
    /// start and at every config reload (new connections get the new one).
    #[serde(default)]
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// PEM private key of `tls_cert_file`.
    #[serde(default)]
    pub tls_key_file: Option<std::path::PathBuf>,
    /// PEM CA certificates: with it, clients must present a certificate
    /// signed by one of them (mTLS). Needs `tls_cert_file`.
    #[serde(default)]
    pub tls_client_ca_file: Option<std::path::PathBuf>,
    /// How long a graceful shutdown waits for in-flight requests.
    #[serde(default = "defaults::shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// Longest wait for a request's headers (HTTP/1), counted from when
    /// the connection is ready for a request: a slow client cannot hold a
    /// connection, and an idle keep-alive connection is closed after it.
    #[serde(default = "defaults::header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// Longest time to receive a request's whole body.
    #[serde(default = "defaults::body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// Deadline of a whole request (a waiting acquire gets its `waitMs`
    /// on top); past it the answer is 504 `timeout`.
    #[serde(default = "defaults::http_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Lock API requests (acquire, renew, renew-batch, release, inspect) a
    /// replica serves at once; beyond it, 503 `overloaded` at once.
    /// Acquires and inspects may use half of them, releases 90% (the
    /// acquires' share included), renewals all: the releases of admitted
    /// acquires and the renewals of held locks find room. Read at start.
    #[serde(default = "defaults::max_in_flight")]
    pub max_in_flight: usize,
}

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
    /// How often active locks per shard are counted (a count-only range).
    #[serde(default = "defaults::count_interval_ms")]
    pub count_interval_ms: u64,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RingSettings {
    /// Virtual nodes per unit of shard weight.
    #[serde(default = "defaults::vnodes")]
    pub vnodes: u32,
}

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
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSettings {
    /// Bearer token admin calls must carry. Without one, admin routes
    /// answer only to clients on loopback addresses.
    #[serde(default)]
    pub token: Option<String>,
    /// How often the config file is checked for changes (0: never; SIGHUP
    /// and `POST /admin/v1/reload` still reload).
    #[serde(default = "defaults::reload_poll_ms")]
    pub reload_poll_ms: u64,
}

impl Default for AdminSettings {
    fn default() -> Self {
        Self {
            token: None,
            reload_poll_ms: defaults::reload_poll_ms(),
        }
    }
}

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

#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ShardSettings {
    /// Stable name; it is part of every lockId and of the ring fingerprint.
    pub name: String,
    /// Client URLs of the cluster's members.
    pub endpoints: Vec<String>,
    /// Relative share of names this shard receives.
    #[serde(default = "defaults::weight")]
    pub weight: u32,
}

mod defaults {
    pub fn shutdown_grace_ms() -> u64 {
        10_000
    }
    pub fn header_read_timeout_ms() -> u64 {
        10_000
    }
    pub fn body_read_timeout_ms() -> u64 {
        10_000
    }
    pub fn http_request_timeout_ms() -> u64 {
        30_000
    }
    pub fn max_in_flight() -> usize {
        20_000
    }

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
    pub fn count_interval_ms() -> u64 {
        10_000
    }
    pub fn reload_poll_ms() -> u64 {
        2_000
    }
    pub fn vnodes() -> u32 {
        160
    }
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
    pub fn weight() -> u32 {
        1
    }
}

impl Default for EtcdSettings {
    fn default() -> Self {
        Self {
            prefix: defaults::prefix(),
            request_timeout_ms: defaults::request_timeout_ms(),
            connect_timeout_ms: defaults::connect_timeout_ms(),
            health_interval_ms: defaults::health_interval_ms(),
            keepalive_coalesce_ms: defaults::keepalive_coalesce_ms(),
            count_interval_ms: defaults::count_interval_ms(),
        }
    }
}

impl Default for RingSettings {
    fn default() -> Self {
        Self {
            vnodes: defaults::vnodes(),
        }
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
        }
    }
}

/// Why a configuration was refused. Each message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid config: {0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(msg.into())
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

    /// Parses settings from a TOML string (no environment), then validates.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()?
            .try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Checks everything serde cannot: addresses, bounds, shard identity.
    pub fn validate(&self) -> Result<(), ConfigError> {
        parse_addr("server.listen", &self.server.listen)?;
        if let Some(addr) = &self.server.metrics_listen {
            parse_addr("server.metrics_listen", addr)?;
        }
        if !(5..=1_000_000).contains(&self.server.max_in_flight) {
            return Err(invalid(format!(
                "server.max_in_flight = {} must be 5..=1000000",
                self.server.max_in_flight
            )));
        }
        self.validate_etcd()?;
        self.validate_limits()?;
        if self.admin.token.as_deref().is_some_and(|t| t.len() < 16) {
            return Err(invalid("admin.token must be at least 16 characters"));
        }
        let s = &self.server;
        if s.tls_cert_file.is_some() != s.tls_key_file.is_some() {
            return Err(invalid(
                "server.tls_cert_file and server.tls_key_file go together: set both or neither",
            ));
        }
        if s.tls_client_ca_file.is_some() && s.tls_cert_file.is_none() {
            return Err(invalid(
                "server.tls_client_ca_file needs server.tls_cert_file and server.tls_key_file",
            ));
        }
        self.validate_shards()
    }

    fn validate_etcd(&self) -> Result<(), ConfigError> {
        let e = &self.etcd;
        let p = &e.prefix;
        if p.is_empty() || p.ends_with('/') || p.chars().any(char::is_control) {
            return Err(invalid(format!(
                "etcd.prefix {p:?} must be non-empty, printable and not end with '/'"
            )));
        }
        for (key, v) in [
            ("etcd.request_timeout_ms", e.request_timeout_ms),
            ("etcd.connect_timeout_ms", e.connect_timeout_ms),
            ("etcd.health_interval_ms", e.health_interval_ms),
            ("etcd.count_interval_ms", e.count_interval_ms),
            (
                "etcd.keepalive_coalesce_ms",
                e.keepalive_coalesce_ms.max(10),
            ),
            (
                "server.shutdown_grace_ms",
                self.server.shutdown_grace_ms.max(10),
            ),
            (
                "server.header_read_timeout_ms",
                self.server.header_read_timeout_ms,
            ),
            (
                "server.body_read_timeout_ms",
                self.server.body_read_timeout_ms,
            ),
            ("server.request_timeout_ms", self.server.request_timeout_ms),
        ] {
            if !(10..=600_000).contains(&v) {
                return Err(invalid(format!("{key} = {v} must be 10..=600000")));
            }
        }
        if !(1..=10_000).contains(&self.ring.vnodes) {
            return Err(invalid("ring.vnodes must be 1..=10000"));
        }
        Ok(())
    }

    fn validate_limits(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        // etcd's minimum lease TTL is 2 s and leases are whole seconds.
        if l.min_ttl_ms < 2_000 || l.min_ttl_ms > l.max_ttl_ms {
            return Err(invalid(format!(
                "limits.min_ttl_ms = {} must be >= 2000 and <= limits.max_ttl_ms = {}",
                l.min_ttl_ms, l.max_ttl_ms
            )));
        }
        if l.max_ttl_ms > 86_400_000 {
            return Err(invalid("limits.max_ttl_ms must be <= 86400000 (one day)"));
        }
        if l.max_name_bytes == 0 || l.max_client_id_bytes == 0 || l.max_batch == 0 {
            return Err(invalid(
                "limits.max_name_bytes, max_client_id_bytes and max_batch must be > 0",
            ));
        }
        if !(1..=600_000).contains(&l.max_wait_ms) || !(1..=1_000_000).contains(&l.max_waiters) {
            return Err(invalid(
                "limits.max_wait_ms must be 1..=600000 and limits.max_waiters 1..=1000000",
            ));
        }
        if l.max_body_bytes < 1_024 {
            return Err(invalid("limits.max_body_bytes must be at least 1024"));
        }
        if l.acquires_per_client_per_sec > 1_000_000 {
            return Err(invalid(format!(
                "limits.acquires_per_client_per_sec = {} must be 0 (no limit) to 1000000",
                l.acquires_per_client_per_sec
            )));
        }
        Ok(())
    }

    fn validate_shards(&self) -> Result<(), ConfigError> {
        if self.shards.is_empty() {
            return Err(invalid("no shards configured: add at least one [[shards]]"));
        }
        let mut seen = HashSet::new();
        for s in &self.shards {
            if s.name.is_empty()
                || s.name.len() > 64
                || !s
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(invalid(format!(
                    "shard name {:?} must be 1-64 characters of [A-Za-z0-9_-]",
                    s.name
                )));
            }
            if !seen.insert(s.name.as_str()) {
                return Err(invalid(format!("duplicate shard name {:?}", s.name)));
            }
            if s.endpoints.is_empty() {
                return Err(invalid(format!("shard {:?} has no endpoints", s.name)));
            }
            for ep in &s.endpoints {
                validate_endpoint(&s.name, ep)?;
            }
            if !(1..=1_000).contains(&s.weight) {
                return Err(invalid(format!(
                    "shard {:?} weight {} must be 1..=1000",
                    s.name, s.weight
                )));
            }
        }
        Ok(())
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.etcd.request_timeout_ms)
    }

    /// The HTTP server's timeouts.
    pub fn http_timeouts(&self) -> HttpTimeouts {
        let ms = Duration::from_millis;
        let s = &self.server;
        HttpTimeouts {
            header_read: ms(s.header_read_timeout_ms),
            body_read: ms(s.body_read_timeout_ms),
            request: ms(s.request_timeout_ms),
        }
    }
}

/// How long the HTTP server waits for each part of a request.
#[derive(Debug, Clone, Copy)]
pub struct HttpTimeouts {
    pub header_read: Duration,
    pub body_read: Duration,
    pub request: Duration,
}

fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| invalid(format!("{key} = {value:?} is not an IP:port address")))
}

fn validate_endpoint(shard: &str, ep: &str) -> Result<(), ConfigError> {
    let bad = || {
        invalid(format!(
            "shard {shard:?} endpoint {ep:?} must be an http://host:port URL"
        ))
    };
    let uri: http::Uri = ep.parse().map_err(|_| bad())?;
    match (uri.scheme_str(), uri.host(), uri.port_u16()) {
        (Some("http"), Some(h), Some(_)) if !h.is_empty() => Ok(()),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        [server]
        listen = "127.0.0.1:8080"
        [etcd]
        prefix = "/lockrouter"
        [[shards]]
        name = "a"
        endpoints = ["http://127.0.0.1:2379"]
    "#;

    #[test]
    fn minimal_config_gets_defaults() {
        let s = Settings::from_toml(MINIMAL).unwrap();
        assert_eq!(s.shards[0].weight, 1);
        assert_eq!(s.limits.max_batch, 1_000);
        assert_eq!(s.etcd.request_timeout_ms, 3_000);
    }

    fn rejects(text: &str, needle: &str) {
        let err = Settings::from_toml(text).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }

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
    }
}
