//! Settings: a TOML file, then `LOCKROUTER__SECTION__KEY` environment
//! overrides, deserialised into typed structs and validated before anything
//! starts. Unknown keys are rejected so that a typo never silently falls back
//! to a default. This module touches nothing but the file system and the
//! environment. [`keys`] reads every key off the settings types.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

pub mod keys;

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
    /// Threads that serve requests and talk to etcd; 0: one per core.
    /// Where the router shares its cores with etcd or other busy
    /// processes, 1 spends less CPU per request (no hand-offs between
    /// threads) at the cost of at most one core of throughput. Read at
    /// start.
    #[serde(default)]
    pub worker_threads: usize,
    /// Renewals first: once renewals on a shard take longer than this (two,
    /// and a tenth of those in a quarter second), its acquires are refused
    /// with 503 `overloaded` for a second; renewals never are. 0: off.
    #[serde(default = "defaults::renewal_budget_ms")]
    pub renewal_budget_ms: u64,
    /// One info line per HTTP request, target `lockrouter::access` (see
    /// `src/http/access.rs` for its fields). Applies at once on reload.
    #[serde(default)]
    pub access_log: bool,
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
    /// A session lease is sent a keepalive only when less than this
    /// percentage of its TTL is known to be left (100: at every renewal,
    /// coalesced as above); renewals in between are answered with the time
    /// the lease really has.
    #[serde(default = "defaults::keepalive_below_pct")]
    pub keepalive_below_pct: u8,
    /// Keepalive bursts on a shard's main stream are at least this many ms
    /// apart: a keepalive that finds none sent within it, or that an acquire
    /// waits on, goes at once; a renewal's else waits for the next burst
    /// with every other that comes meanwhile
    /// (one HTTP/2 frame, which etcd reads once); 0: each alone.
    #[serde(default = "defaults::keepalive_burst_ms")]
    pub keepalive_burst_ms: u64,
    /// How often active locks per shard are counted (a count-only range).
    #[serde(default = "defaults::count_interval_ms")]
    pub count_interval_ms: u64,
}

/// Least time between two barriers of the lock-key cache on one shard (a
/// constant, not a setting). Renewals tolerate a few ms of waiting (they
/// come every third of a TTL); etcd pays for every barrier with a raft
/// write. Under load this caps barriers at 50/s per shard and replica,
/// whatever the renewal rate; a renewal that finds no barrier sent in the
/// last 20 ms gets one at once. Kept here, below every layer, so that the
/// cache (`shard/cache.rs`) and the capacity model (`cli/capacity.rs`)
/// read the one value.
pub const BARRIER_SPACING: Duration = Duration::from_millis(20);

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
    /// Largest `metadata` an acquire may attach, as compact JSON.
    #[serde(default = "defaults::max_metadata_bytes")]
    pub max_metadata_bytes: usize,
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
    /// Host names (besides loopback addresses and `localhost`) that admin
    /// requests may be addressed to while the admin routes are open to
    /// loopback clients: any other `Host` is refused, so that a web page
    /// that rebinds its own name to 127.0.0.1 cannot reach them.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
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

/// Principals (tenants) and sealed lockIds (see docs/security.md).
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSettings {
    /// Keys lockIds are sealed with (HMAC-SHA-256): the first seals new
    /// lockIds, every one opens them, so a key is rotated by adding the new
    /// one behind it, moving it first, then dropping the old one. Without
    /// keys, lockIds are only checksummed. Read at start and at reload.
    #[serde(default)]
    pub lock_id_keys: Vec<LockIdKey>,
    /// Also accept checksummed lockIds while keys are configured: for
    /// turning sealing on without losing the locks held meanwhile. Not with
    /// principals (a checksummed lockId names no owner).
    #[serde(default)]
    pub accept_unsigned_lock_ids: bool,
    /// Who may call the lock API. With any, every lock API call must
    /// authenticate as one of them (401 otherwise) and stays within its
    /// names (403 otherwise). Reloaded with the config.
    #[serde(default)]
    pub principals: Vec<PrincipalSettings>,
}

/// One key lockIds are sealed with: `secret` (base64 of at least 32 bytes)
/// or `secret_file` (a file holding the same), not both.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct LockIdKey {
    /// 1 to 16 characters of `[A-Za-z0-9_-]`, named in every lockId it seals.
    pub id: String,
    #[serde(default, serialize_with = "masked")]
    pub secret: Option<String>,
    #[serde(default)]
    pub secret_file: Option<std::path::PathBuf>,
}

/// A caller of the lock API: who it is (a bearer token, whose SHA-256 is
/// all the config holds, or a client certificate's identity) and what it
/// may do.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalSettings {
    /// 1 to 64 characters of `[A-Za-z0-9_-]`, unique; recorded with every
    /// lock it holds.
    pub name: String,
    /// Hex SHA-256 of each bearer token it may send (`lockrouter auth
    /// new-token` makes a token and prints both); several while a token is
    /// rotated.
    #[serde(default)]
    pub token_sha256: Vec<String>,
    /// A DNS name, URI or common name its client certificate carries (needs
    /// `server.tls_client_ca_file`).
    #[serde(default)]
    pub tls_identity: Option<String>,
    /// The names it may acquire and inspect: those starting with one of
    /// these (`""` for every name; none for an admin-only principal).
    #[serde(default)]
    pub name_prefixes: Vec<String>,
    /// If set, every clientId it acquires with must start with this.
    #[serde(default)]
    pub client_id_prefix: Option<String>,
    /// May call `/admin/v1/*` and see holders.
    #[serde(default)]
    pub admin: bool,
    /// Acquires it may start per second through one router, in bursts of as
    /// many (0: no limit of its own). Read at start and at reload.
    #[serde(default)]
    pub acquires_per_sec: u32,
    /// Most locks it may hold at once, across every shard and replica
    /// (0: no bound); past it, acquires of new locks get 403.
    #[serde(default)]
    pub max_held_locks: u64,
    /// Most session leases (clientId and TTL, per shard and replica) its
    /// locks may ride on (0: no bound); past it, acquires that need a new
    /// session get 403.
    #[serde(default)]
    pub max_sessions: u64,
}

fn masked<S: serde::Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(_) => s.serialize_str("***"),
        None => s.serialize_none(),
    }
}

impl AuthSettings {
    /// The lockId keys' (id, secret), in order, reading `secret_file`s.
    pub fn lock_id_secrets(&self) -> Result<Vec<(String, Vec<u8>)>, ConfigError> {
        use base64::Engine;
        self.lock_id_keys
            .iter()
            .map(|k| {
                let key = || format!("auth.lock_id_keys {:?}", k.id);
                let text = match (&k.secret, &k.secret_file) {
                    (Some(s), None) => s.clone(),
                    (None, Some(path)) => {
                        std::fs::read_to_string(path).map_err(|source| ConfigError::SecretFile {
                            key: key(),
                            path: path.clone(),
                            source,
                        })?
                    }
                    _ => {
                        return Err(invalid(format!(
                            "{} needs exactly one of secret and secret_file",
                            key()
                        )))
                    }
                };
                let secret = base64::engine::general_purpose::STANDARD
                    .decode(text.trim())
                    .map_err(|source| ConfigError::NotBase64 { key: key(), source })?;
                Ok((k.id.clone(), secret))
            })
            .collect()
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

/// One shard. `Default` is for building settings in code: an empty name
/// and no endpoints never validate.
///
/// The TLS and user keys are serialised only when set: a previous ring
/// recorded on the shards (see `keys.rs`) carries name, endpoints and
/// weight only (see [`ShardSettings::recordable`]), in the bytes earlier
/// releases wrote and read.
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ShardSettings {
    /// Stable name; it is part of every lockId and of the ring fingerprint.
    pub name: String,
    /// Client URLs of the cluster's members: all `http://` or all
    /// `https://`.
    pub endpoints: Vec<String>,
    /// Relative share of names this shard receives.
    #[serde(default = "defaults::weight")]
    pub weight: u32,
    /// PEM CA certificates that signed the members' certificates: the only
    /// roots trusted for this shard. Required with `https://` endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate chain the router presents (etcd started
    /// with `--client-cert-auth`); with `tls_key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// PEM private key of `tls_cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<std::path::PathBuf>,
    /// etcd user the router authenticates as (etcd auth enabled); with
    /// `password_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// A file holding that user's password (one trailing newline is not
    /// part of it), so that no secret sits in the config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<std::path::PathBuf>,
}

impl ShardSettings {
    /// What a record on the shards may carry of this shard: name,
    /// endpoints and weight. File paths and user names stay in each
    /// replica's own config: a router never reads a file, nor sends a
    /// password, because a record in etcd named it.
    pub fn recordable(&self) -> Self {
        Self {
            name: self.name.clone(),
            endpoints: self.endpoints.clone(),
            weight: self.weight,
            ..Self::default()
        }
    }

    /// Whether the endpoints are `https://` (validated: all or none).
    pub fn uses_tls(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }
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
    pub fn renewal_budget_ms() -> u64 {
        500
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
    pub fn keepalive_burst_ms() -> u64 {
        20
    }
    pub fn keepalive_below_pct() -> u8 {
        50
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
    pub fn max_metadata_bytes() -> usize {
        1_024
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
            keepalive_burst_ms: defaults::keepalive_burst_ms(),
            keepalive_coalesce_ms: defaults::keepalive_coalesce_ms(),
            keepalive_below_pct: defaults::keepalive_below_pct(),
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
            max_metadata_bytes: defaults::max_metadata_bytes(),
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
    /// A secret's file that cannot be read.
    #[error("invalid config: {key}: cannot read secret_file {}: {source}", path.display())]
    SecretFile {
        /// The setting that names the file.
        key: String,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A secret that is not base64.
    #[error("invalid config: {key}: the secret is not base64")]
    NotBase64 {
        /// The setting that holds the secret.
        key: String,
        #[source]
        source: base64::DecodeError,
    },
    /// A `LOCKROUTER__…` variable that names no key: said to be a variable,
    /// since the file is where people look first.
    #[error(
        "invalid config: the environment variable {var} sets {key}, which is not a config key \
         (it comes from the environment, not from the config file); {known}"
    )]
    UnknownEnvKey {
        var: String,
        key: String,
        /// The keys that could have been meant.
        known: String,
    },
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
        if self.server.worker_threads > 1_024 {
            return Err(invalid(format!(
                "server.worker_threads = {} must be 0 (one per core) to 1024",
                self.server.worker_threads
            )));
        }
        if self.server.renewal_budget_ms > 600_000 {
            return Err(invalid(format!(
                "server.renewal_budget_ms = {} must be 0 (off) to 600000",
                self.server.renewal_budget_ms
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
        self.validate_auth()?;
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
        // Below 40 %, a client renewing every third of its TTL could find
        // its lease with less than a third left and lose it before its
        // next renewal.
        if !(40..=100).contains(&e.keepalive_below_pct) {
            return Err(invalid(format!(
                "etcd.keepalive_below_pct = {} must be 40..=100",
                e.keepalive_below_pct
            )));
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
        if l.max_metadata_bytes > 65_536 {
            return Err(invalid("limits.max_metadata_bytes must be at most 65536"));
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

    fn validate_auth(&self) -> Result<(), ConfigError> {
        let a = &self.auth;
        for k in &a.lock_id_keys {
            if k.secret.is_some() == k.secret_file.is_some() {
                return Err(invalid(format!(
                    "auth.lock_id_keys {:?} needs exactly one of secret and secret_file",
                    k.id
                )));
            }
        }
        if a.principals.is_empty() {
            return Ok(());
        }
        if a.lock_id_keys.is_empty() || a.accept_unsigned_lock_ids {
            return Err(invalid(
                "auth.principals need auth.lock_id_keys, and no auth.accept_unsigned_lock_ids: \
                 a lockId must name its owner under a key",
            ));
        }
        let mut names = HashSet::new();
        let mut tokens = HashSet::new();
        let mut identities = HashSet::new();
        for p in &a.principals {
            let what = format!("auth.principals {:?}", p.name);
            if !short_name(&p.name, 64) {
                return Err(invalid(format!(
                    "{what}: name must be 1 to 64 characters of [A-Za-z0-9_-]"
                )));
            }
            if !names.insert(p.name.as_str()) {
                return Err(invalid(format!("{what} is listed twice")));
            }
            if p.token_sha256.is_empty() && p.tls_identity.is_none() {
                return Err(invalid(format!(
                    "{what} needs token_sha256 or tls_identity (or both)"
                )));
            }
            for hash in &p.token_sha256 {
                if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(invalid(format!(
                        "{what}: token_sha256 must be 64 hex digits (the SHA-256 of the token)"
                    )));
                }
                if !tokens.insert(hash.to_ascii_lowercase()) {
                    return Err(invalid(format!(
                        "{what}: its token_sha256 is another principal's"
                    )));
                }
            }
            if let Some(id) = &p.tls_identity {
                if self.server.tls_client_ca_file.is_none() {
                    return Err(invalid(format!(
                        "{what}: tls_identity needs server.tls_client_ca_file (client certificates)"
                    )));
                }
                if id.is_empty() || id.len() > 255 || id.chars().any(char::is_control) {
                    return Err(invalid(format!(
                        "{what}: tls_identity must be 1 to 255 printable bytes"
                    )));
                }
                if !identities.insert(id.as_str()) {
                    return Err(invalid(format!(
                        "{what}: its tls_identity is another principal's"
                    )));
                }
            }
            let l = &self.limits;
            for prefix in &p.name_prefixes {
                if prefix.len() > l.max_name_bytes || prefix.chars().any(char::is_control) {
                    return Err(invalid(format!(
                        "{what}: name prefix {prefix:?} must be at most limits.max_name_bytes printable bytes"
                    )));
                }
            }
            if let Some(prefix) = &p.client_id_prefix {
                if prefix.is_empty()
                    || prefix.len() >= l.max_client_id_bytes
                    || prefix.chars().any(char::is_control)
                {
                    return Err(invalid(format!(
                        "{what}: client_id_prefix must be 1 to limits.max_client_id_bytes - 1 printable bytes"
                    )));
                }
            }
            if p.acquires_per_sec > 1_000_000 {
                return Err(invalid(format!(
                    "{what}: acquires_per_sec must be 0 (no limit) to 1000000"
                )));
            }
        }
        Ok(())
    }

    fn validate_shards(&self) -> Result<(), ConfigError> {
        if self.shards.is_empty() {
            return Err(invalid("no shards configured: add at least one [[shards]]"));
        }
        let mut seen = HashSet::new();
        for s in &self.shards {
            if !short_name(&s.name, 64) {
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
            validate_shard_access(s)?;
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

/// 1 to `max` characters of `[A-Za-z0-9_-]`.
fn short_name(name: &str, max: usize) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| invalid(format!("{key} = {value:?} is not an IP:port address")))
}

fn validate_endpoint(shard: &str, ep: &str) -> Result<(), ConfigError> {
    let bad = || {
        invalid(format!(
            "shard {shard:?} endpoint {ep:?} must be an http://host:port or https://host:port URL"
        ))
    };
    let uri: http::Uri = ep.parse().map_err(|_| bad())?;
    match (uri.scheme_str(), uri.host(), uri.port_u16()) {
        (Some("http" | "https"), Some(h), Some(_)) if !h.is_empty() => Ok(()),
        _ => Err(bad()),
    }
}

/// How a shard is reached: one scheme for all its members, TLS files only
/// with `https://` (and a CA with it: the router trusts no system roots
/// for etcd, whose certificates a private CA signs), a client certificate
/// with its key, a user with a password file. Whether the files can be
/// used is checked when they are read (at start and at every reload).
fn validate_shard_access(s: &ShardSettings) -> Result<(), ConfigError> {
    let name = &s.name;
    let https = s
        .endpoints
        .iter()
        .filter(|e| e.starts_with("https://"))
        .count();
    if https != 0 && https != s.endpoints.len() {
        return Err(invalid(format!(
            "shard {name:?} endpoints mix http:// and https://: use one scheme for all of its members"
        )));
    }
    let tls_files = [
        ("tls_ca_file", s.tls_ca_file.is_some()),
        ("tls_cert_file", s.tls_cert_file.is_some()),
        ("tls_key_file", s.tls_key_file.is_some()),
    ];
    if s.uses_tls() && s.tls_ca_file.is_none() {
        return Err(invalid(format!(
            "shard {name:?}: https:// endpoints need shards[].tls_ca_file, the CA that signed the members' certificates"
        )));
    }
    if let Some((key, _)) = tls_files.iter().find(|(_, set)| *set && !s.uses_tls()) {
        return Err(invalid(format!(
            "shard {name:?}: shards[].{key} needs https:// endpoints"
        )));
    }
    if s.tls_cert_file.is_some() != s.tls_key_file.is_some() {
        return Err(invalid(format!(
            "shard {name:?}: shards[].tls_cert_file and shards[].tls_key_file go together: set both or neither"
        )));
    }
    match (&s.username, &s.password_file) {
        (Some(user), Some(_)) if user.is_empty() || user.chars().any(char::is_control) => {
            Err(invalid(format!(
                "shard {name:?}: shards[].username must be non-empty and printable"
            )))
        }
        (Some(_), None) | (None, Some(_)) => Err(invalid(format!(
            "shard {name:?}: shards[].username and shards[].password_file go together: set both or neither"
        ))),
        _ => Ok(()),
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

    /// `[auth]` with a key and one principal `p`, then `extra` lines in
    /// the principal's table.
    fn with_auth(extra: &str) -> String {
        let hash = "ab".repeat(32);
        format!(
            "{MINIMAL}\n[[auth.lock_id_keys]]\nid = \"k1\"\nsecret = \"{}\"\n\
             [[auth.principals]]\nname = \"p\"\ntoken_sha256 = [\"{hash}\"]\n{extra}",
            "A".repeat(44)
        )
    }

    #[test]
    fn auth_settings_are_checked_and_secrets_masked() {
        let ok = Settings::from_toml(&with_auth("name_prefixes = [\"p/\"]")).unwrap();
        assert_eq!(ok.auth.principals[0].name_prefixes, ["p/"]);
        assert_eq!(ok.auth.lock_id_secrets().unwrap()[0].1.len(), 33);
        let shown = serde_json::to_string(&ok).unwrap();
        assert!(
            !shown.contains(&"A".repeat(44)),
            "the secret is masked: {shown}"
        );
        assert!(shown.contains("***"));
        // Principals without a key would get lockIds naming no owner.
        let no_key = with_auth("").replace("[[auth.lock_id_keys]]\nid = \"k1\"\n", "");
        let no_key = no_key.replace(&format!("secret = \"{}\"\n", "A".repeat(44)), "");
        rejects(&no_key, "auth.lock_id_keys");
        rejects(
            &with_auth("").replace(
                "\n[[auth.lock_id_keys]]",
                "\n[auth]\naccept_unsigned_lock_ids = true\n[[auth.lock_id_keys]]",
            ),
            "accept_unsigned",
        );
        rejects(
            &with_auth("tls_identity = \"w.example\""),
            "tls_client_ca_file",
        );
        rejects(&with_auth("").replace(&"ab".repeat(32), "abc"), "64 hex");
        rejects(&with_auth("client_id_prefix = \"\""), "client_id_prefix");
        rejects(
            &format!(
                "{}\n[[auth.principals]]\nname = \"p\"\ntoken_sha256 = [\"{}\"]",
                with_auth(""),
                "cd".repeat(32)
            ),
            "listed twice",
        );
        rejects(
            &format!(
                "{}\n[[auth.principals]]\nname = \"q\"\ntoken_sha256 = [\"{}\"]",
                with_auth(""),
                "ab".repeat(32)
            ),
            "another principal",
        );
        rejects(
            &with_auth("").replace("name = \"p\"\n", "name = \"p q\"\n"),
            "[A-Za-z0-9_-]",
        );
        rejects(
            &with_auth("").replace("token_sha256 = [", "tls_identity_x = ["),
            "tls_identity_x",
        );
        let both = with_auth("").replace("secret = ", "secret_file = \"/k\"\nsecret = ");
        rejects(&both, "exactly one of secret and secret_file");
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

    #[test]
    fn shard_tls_and_user_settings_are_checked_and_never_recorded() {
        let https = MINIMAL.replace("http://", "https://");
        rejects(&https, "shards[].tls_ca_file");
        let with_ca = format!("{https}tls_ca_file = \"/ca.pem\"\n");
        let s = Settings::from_toml(&with_ca).unwrap();
        assert!(s.shards[0].uses_tls());
        rejects(
            &with_ca.replace(
                "[\"https://127.0.0.1:2379\"]",
                "[\"https://127.0.0.1:2379\", \"http://127.0.0.1:2380\"]",
            ),
            "mix http:// and https://",
        );
        rejects(
            &format!("{with_ca}tls_key_file = \"/k.pem\"\n"),
            "shards[].tls_cert_file and shards[].tls_key_file",
        );
        rejects(
            &format!("{MINIMAL}tls_cert_file = \"/c.pem\"\n"),
            "shards[].tls_cert_file needs https://",
        );
        rejects(
            &format!("{MINIMAL}username = \"router\"\n"),
            "shards[].username and shards[].password_file",
        );
        rejects(
            &format!("{MINIMAL}username = \"\"\npassword_file = \"/pw\"\n"),
            "shards[].username must be non-empty",
        );
        rejects(&format!("{MINIMAL}password = \"x\"\n"), "password");
        // What a record on the shards carries: no file, no user, and the
        // bytes of a shard without them.
        let full = format!(
            "{with_ca}tls_cert_file = \"/c.pem\"\ntls_key_file = \"/k.pem\"\n\
             username = \"router\"\npassword_file = \"/pw\"\n"
        );
        let shard = &Settings::from_toml(&full).unwrap().shards[0];
        let recorded = serde_json::to_string(&shard.recordable()).unwrap();
        assert_eq!(
            recorded,
            r#"{"name":"a","endpoints":["https://127.0.0.1:2379"],"weight":1}"#
        );
    }
}
