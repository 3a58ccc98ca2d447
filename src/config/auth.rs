//! `[auth]`: the principals that may call the lock API and the keys
//! lockIds are sealed with (see docs/security.md). A key's secret is a
//! [`Secret`], in the file and as read from its `secret_file`.

use std::collections::HashSet;
use std::path::PathBuf;

use serde::Deserialize;

use super::limits::Limits;
use super::secret::Secret;
use super::server::ServerSettings;
use super::validate::{invalid, short_name, ConfigError};

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
    #[serde(default)]
    pub secret: Option<Secret>,
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
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
    /// many (0: no limit of its own). Read at start and at reload; a reload
    /// that leaves it unchanged leaves what the principal has used of it.
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

/// A lockId key as read: its id and its secret's bytes.
pub type LockIdSecret = (String, Secret<Vec<u8>>);

impl AuthSettings {
    /// The lockId keys' (id, secret), in order, reading `secret_file`s.
    pub fn lock_id_secrets(&self) -> Result<Vec<LockIdSecret>, ConfigError> {
        use base64::Engine;
        self.lock_id_keys
            .iter()
            .map(|k| {
                let key = || format!("auth.lock_id_keys {:?}", k.id);
                let text =
                    match (&k.secret, &k.secret_file) {
                        (Some(s), None) => s.clone(),
                        (None, Some(path)) => std::fs::read_to_string(path)
                            .map(Secret::new)
                            .map_err(|source| ConfigError::SecretFile {
                                key: key(),
                                path: path.clone(),
                                source,
                            })?,
                        _ => {
                            return Err(invalid(format!(
                                "{} needs exactly one of secret and secret_file",
                                key()
                            )))
                        }
                    };
                let secret = base64::engine::general_purpose::STANDARD
                    .decode(text.expose().trim())
                    .map_err(|source| ConfigError::NotBase64 { key: key(), source })?;
                Ok((k.id.clone(), Secret::new(secret)))
            })
            .collect()
    }

    /// Checks the keys and the principals; a principal's prefixes are
    /// bounded by `limits`, and a `tls_identity` needs `server`'s client CA.
    pub(super) fn validate(
        &self,
        server: &ServerSettings,
        limits: &Limits,
    ) -> Result<(), ConfigError> {
        for k in &self.lock_id_keys {
            if k.secret.is_some() == k.secret_file.is_some() {
                return Err(invalid(format!(
                    "auth.lock_id_keys {:?} needs exactly one of secret and secret_file",
                    k.id
                )));
            }
        }
        if self.principals.is_empty() {
            return Ok(());
        }
        if self.lock_id_keys.is_empty() || self.accept_unsigned_lock_ids {
            return Err(invalid(
                "auth.principals need auth.lock_id_keys, and no auth.accept_unsigned_lock_ids: \
                 a lockId must name its owner under a key",
            ));
        }
        let mut names = HashSet::new();
        let mut tokens = HashSet::new();
        let mut identities = HashSet::new();
        for p in &self.principals {
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
                if server.tls_client_ca_file.is_none() {
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
            p.validate_bounds(&what, limits)?;
        }
        Ok(())
    }
}

impl PrincipalSettings {
    /// Its prefixes within `limits`, its rate within reason.
    fn validate_bounds(&self, what: &str, l: &Limits) -> Result<(), ConfigError> {
        for prefix in &self.name_prefixes {
            if prefix.len() > l.max_name_bytes || prefix.chars().any(char::is_control) {
                return Err(invalid(format!(
                    "{what}: name prefix {prefix:?} must be at most limits.max_name_bytes printable bytes"
                )));
            }
        }
        if let Some(prefix) = &self.client_id_prefix {
            if prefix.is_empty()
                || prefix.len() >= l.max_client_id_bytes
                || prefix.chars().any(char::is_control)
            {
                return Err(invalid(format!(
                    "{what}: client_id_prefix must be 1 to limits.max_client_id_bytes - 1 printable bytes"
                )));
            }
        }
        if self.acquires_per_sec > 1_000_000 {
            return Err(invalid(format!(
                "{what}: acquires_per_sec must be 0 (no limit) to 1000000"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{rejects, MINIMAL};
    use crate::config::Settings;

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
        assert_eq!(ok.auth.lock_id_secrets().unwrap()[0].1.expose().len(), 33);
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
    fn no_secret_shows_in_the_settings_debug_or_a_read_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("k2.key");
        let from_file = "B".repeat(44);
        std::fs::write(&file, format!("{from_file}\n")).unwrap();
        let admin = "the-admin-token-0123456789";
        let text = format!(
            "{}\n[[auth.lock_id_keys]]\nid = \"k2\"\nsecret_file = \"{}\"\n\
             [admin]\ntoken = \"{admin}\"\n",
            with_auth("name_prefixes = [\"p/\"]"),
            file.display()
        );
        let settings = Settings::from_toml(&text).unwrap();
        let keys = settings.auth.lock_id_secrets().unwrap();
        assert_eq!(keys.len(), 2);
        let shown = format!("{settings:?} {settings:#?} {keys:?}");
        for secret in [&"A".repeat(44), &from_file, admin] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("Secret(***)"), "{shown}");
        assert_eq!(settings.admin.token.as_ref().unwrap().expose(), admin);
    }
}
