//! Why a config is refused ([`ConfigError`]), and the rules more than one
//! section checks. Each section validates itself next to its settings;
//! every message names the offending key.

use std::path::PathBuf;

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
        path: PathBuf,
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

pub(super) fn invalid(msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(msg.into())
}

/// 1 to `max` characters of `[A-Za-z0-9_-]`: shard and principal names.
pub(super) fn short_name(name: &str, max: usize) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}
