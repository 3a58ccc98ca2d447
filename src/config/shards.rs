//! `[[shards]]` and `[ring]`: the etcd clusters lock names are spread over,
//! how each is reached (its scheme, TLS files and user), and what decides
//! placement (part of the ring fingerprint).

use std::collections::HashSet;
use std::path::PathBuf;

use serde::Deserialize;

use super::validate::{invalid, short_name, ConfigError};

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RingSettings {
    /// Virtual nodes per unit of shard weight.
    #[serde(default = "defaults::vnodes")]
    pub vnodes: u32,
}

impl RingSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=10_000).contains(&self.vnodes) {
            return Err(invalid("ring.vnodes must be 1..=10000"));
        }
        Ok(())
    }
}

impl Default for RingSettings {
    fn default() -> Self {
        Self {
            vnodes: defaults::vnodes(),
        }
    }
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
    pub tls_ca_file: Option<PathBuf>,
    /// PEM client certificate chain the router presents (etcd started
    /// with `--client-cert-auth`); with `tls_key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// etcd user the router authenticates as (etcd auth enabled); with
    /// `password_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// A file holding that user's password (one trailing newline is not
    /// part of it), so that no secret sits in the config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
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

/// Checks every shard: at least one, names unique, endpoints and access
/// coherent, weights in bounds.
pub(super) fn validate(shards: &[ShardSettings]) -> Result<(), ConfigError> {
    if shards.is_empty() {
        return Err(invalid("no shards configured: add at least one [[shards]]"));
    }
    let mut seen = HashSet::new();
    for s in shards {
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
        validate_access(s)?;
        if !(1..=1_000).contains(&s.weight) {
            return Err(invalid(format!(
                "shard {:?} weight {} must be 1..=1000",
                s.name, s.weight
            )));
        }
    }
    Ok(())
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
fn validate_access(s: &ShardSettings) -> Result<(), ConfigError> {
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

mod defaults {
    pub fn vnodes() -> u32 {
        160
    }
    pub fn weight() -> u32 {
        1
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{rejects, MINIMAL};
    use crate::config::Settings;

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
