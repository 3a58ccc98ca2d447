//! Who is calling, and what it may do: the principals of `auth.principals`.
//!
//! A principal is known by a bearer token, of which the config holds only
//! the SHA-256 (tokens are random and long, so a fast hash is enough: there
//! is no dictionary to try), or by an identity its client certificate
//! carries (mTLS). Each may lock only names under its prefixes, only with
//! clientIds under its clientId prefix, and touch only the locks it
//! acquired (the owner sealed into their lockIds); an admin principal may
//! also call `/admin/v1/*`. With no principals configured, the lock API is
//! open, as before. The table is built from the config at start and at
//! each reload, and swapped whole; a principal a reload leaves at the
//! same acquire rate keeps its limiter, so a reload gives no fresh burst.
//!
//! [`peer`] reads the identities a client certificate carries;
//! [`keygen`] makes the tokens and keys `lockrouter auth` prints.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use sha2::{Digest, Sha256};

use crate::config::{AuthSettings, ConfigError, PrincipalSettings, Secret};
use crate::refusal::{Denied, RateLimited};
use crate::token::lease_tag::LeaseTag;
use crate::token::lock_id::{BadKeys, Sealer};

mod keygen;
mod peer;

pub use keygen::{new_key, new_token};
pub use peer::PeerIdentity;

/// Why a request was refused here; `http::error` maps each to its status.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    /// No credentials, or credentials that name nobody (401).
    #[error("{0}")]
    Unauthenticated(String),
    /// A known caller outside what it may do (403).
    #[error(transparent)]
    PermissionDenied(#[from] Denied),
    /// Past the principal's own acquire rate (429).
    #[error(transparent)]
    RateLimited(#[from] RateLimited),
}

/// Why `[auth]` cannot be put in force (a start fails, a reload is
/// refused). Each message names the setting.
#[derive(Debug, thiserror::Error)]
pub enum AuthSetupError {
    /// A lockId key's secret cannot be read or decoded.
    #[error(transparent)]
    Secret(#[from] ConfigError),
    /// Keys that cannot seal lockIds.
    #[error("auth.{0}")]
    Keys(#[source] BadKeys),
    /// Two principals whose names hash to one lease tag: their locks'
    /// leases and quota counts would be one.
    #[error(
        "auth.principals {first:?} and {second:?} would share a lease tag \
         (their names hash alike), and so their locks' leases and quota counts: rename one"
    )]
    SharedLeaseTag { first: String, second: String },
}

/// A caller of the lock API, as requests are checked against it.
pub struct Principal {
    pub name: String,
    prefixes: Vec<String>,
    client_id_prefix: Option<String>,
    pub admin: bool,
    /// Its own acquires per second through this replica, if limited;
    /// shared with the principal of the same name and rate in the
    /// generations before and after this one.
    rate: Option<Arc<Rate>>,
    /// Its bound on locks held at once (0: none).
    pub max_held_locks: u64,
    /// Its bound on sessions holding its locks (0: none).
    pub max_sessions: u64,
}

/// A principal's acquire rate and what it has used of it.
struct Rate {
    per_sec: NonZeroU32,
    limiter: DefaultDirectRateLimiter,
}

impl Principal {
    /// The principal `p` describes. `before`: the principal of its name in
    /// the generation this one replaces, whose limiter it keeps if its rate
    /// is unchanged: a reload gives nobody a fresh burst. A new rate starts
    /// a new limiter.
    fn new(p: &PrincipalSettings, before: Option<&Principal>) -> Self {
        let kept = before.and_then(|b| b.rate.as_ref());
        let rate = NonZeroU32::new(p.acquires_per_sec).map(|per_sec| match kept {
            Some(rate) if rate.per_sec == per_sec => rate.clone(),
            _ => Arc::new(Rate {
                per_sec,
                limiter: RateLimiter::direct(Quota::per_second(per_sec)),
            }),
        });
        Self {
            name: p.name.clone(),
            prefixes: p.name_prefixes.clone(),
            client_id_prefix: p.client_id_prefix.clone(),
            admin: p.admin,
            rate,
            max_held_locks: p.max_held_locks,
            max_sessions: p.max_sessions,
        }
    }

    /// Whether `name` is under one of its prefixes.
    pub fn may_lock(&self, name: &str) -> Result<(), AuthError> {
        if self.prefixes.iter().any(|p| name.starts_with(p.as_str())) {
            return Ok(());
        }
        Err(Denied(format!(
            "principal {:?} may not use this name (allowed prefixes: {:?})",
            self.name, self.prefixes
        ))
        .into())
    }

    /// Whether it may acquire `name` as `client_id`, at this moment.
    pub fn may_acquire(&self, name: &str, client_id: &str) -> Result<(), AuthError> {
        self.may_lock(name)?;
        if let Some(prefix) = &self.client_id_prefix {
            if !client_id.starts_with(prefix.as_str()) {
                return Err(Denied(format!(
                    "principal {:?} must use clientIds starting with {prefix:?}",
                    self.name
                ))
                .into());
            }
        }
        if let Some(Rate { per_sec, limiter }) = self.rate.as_deref() {
            limiter.check().map_err(|not_until| RateLimited {
                reason: format!("principal {:?} is past {per_sec} acquires/s", self.name),
                retry_after: not_until.wait_time_from(DefaultClock::default().now()),
            })?;
        }
        Ok(())
    }
}

/// Who a request comes from, before any route's rules apply.
pub enum Credential {
    /// Nothing presented (or a certificate naming no principal).
    None,
    /// The `admin.token` bearer.
    AdminToken,
    /// A principal, by its token or its certificate.
    Principal(Arc<Principal>),
    /// A bearer token that is neither.
    Unknown,
}

/// The principals of one config.
pub struct Principals {
    by_token: HashMap<[u8; 32], Arc<Principal>>,
    by_identity: HashMap<String, Arc<Principal>>,
    /// Every principal, by name: those of the next generation take over
    /// their rate limiters.
    by_name: HashMap<String, Arc<Principal>>,
    /// `admin.token`, compared in constant time.
    admin_token: Option<Secret>,
    /// Whether any principal is configured (the lock API then needs one).
    enabled: bool,
    /// `admin.allowed_hosts`: names besides loopback addresses that admin
    /// requests may be addressed to while the admin routes are open to
    /// loopback clients.
    admin_hosts: Vec<String>,
}

impl Principals {
    /// The principals of `auth`; refused when two of them share a lease
    /// tag and either has a quota (their counts would be one).
    pub fn new(auth: &AuthSettings, admin_token: Option<&str>) -> Result<Self, AuthSetupError> {
        Self::after(None, auth, admin_token)
    }

    /// The principals of `auth`, replacing `before` (a reload's): each
    /// principal of the same name and acquire rate there keeps its rate
    /// limiter, with what it has used of it.
    pub fn after(
        before: Option<&Principals>,
        auth: &AuthSettings,
        admin_token: Option<&str>,
    ) -> Result<Self, AuthSetupError> {
        let mut by_token = HashMap::new();
        let mut by_identity = HashMap::new();
        let mut by_name = HashMap::new();
        let mut tags: HashMap<LeaseTag, &PrincipalSettings> = HashMap::new();
        for p in &auth.principals {
            // The tag confines a principal's lockIds to its own leases and
            // counts its quotas: two principals may not share one.
            if let Some(other) = tags.insert(LeaseTag::of(&p.name), p) {
                return Err(AuthSetupError::SharedLeaseTag {
                    first: other.name.clone(),
                    second: p.name.clone(),
                });
            }
            let before = before.and_then(|b| b.by_name.get(&p.name));
            let principal = Arc::new(Principal::new(p, before.map(Arc::as_ref)));
            by_name.insert(p.name.clone(), principal.clone());
            let hashes = p.token_sha256.iter().filter_map(|h| hex::decode(h).ok());
            for hash in hashes.filter_map(|h| <[u8; 32]>::try_from(h).ok()) {
                by_token.insert(hash, principal.clone());
            }
            if let Some(id) = &p.tls_identity {
                by_identity.insert(id.clone(), principal);
            }
        }
        Ok(Self {
            by_token,
            by_identity,
            by_name,
            admin_token: admin_token.map(|t| Secret::new(t.to_string())),
            enabled: !auth.principals.is_empty(),
            admin_hosts: Vec::new(),
        })
    }

    /// With `admin.allowed_hosts`.
    pub fn with_admin_hosts(mut self, hosts: &[String]) -> Self {
        self.admin_hosts = hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
        self
    }

    /// Whether admin requests may be addressed to `host` (a `Host` header's
    /// name, without its port) while the admin routes are open to loopback
    /// clients: a loopback address, `localhost`, or an allowed name.
    pub fn admin_host_allowed(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.to_canonical().is_loopback())
            || self.admin_hosts.contains(&host)
    }

    /// Whether the lock API needs a principal.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether `admin.token` is set.
    pub fn has_admin_token(&self) -> bool {
        self.admin_token.is_some()
    }

    /// Who `authorization` (the header's value, if any) and the
    /// connection's certificate say the caller is. A bearer token decides
    /// alone: a wrong token is not excused by a certificate.
    pub fn identify(&self, authorization: Option<&[u8]>, peer: &PeerIdentity) -> Credential {
        if let Some(value) = authorization {
            let Some(token) = value.strip_prefix(b"Bearer ") else {
                return Credential::Unknown;
            };
            if let Some(admin) = &self.admin_token {
                if constant_time_eq(token, admin.expose().as_bytes()) {
                    return Credential::AdminToken;
                }
            }
            // The lookup compares hashes, not tokens: what its timing could
            // tell is about a hash, from which no token can be worked back.
            let hash: [u8; 32] = Sha256::digest(token).into();
            return match self.by_token.get(&hash) {
                Some(p) => Credential::Principal(p.clone()),
                None => Credential::Unknown,
            };
        }
        peer.names
            .iter()
            .find_map(|n| self.by_identity.get(n))
            .map_or(Credential::None, |p| Credential::Principal(p.clone()))
    }
}

/// The sealer `auth` configures, reading its key files now.
pub fn sealer(auth: &AuthSettings) -> Result<Sealer, AuthSetupError> {
    let secrets = auth.lock_id_secrets()?;
    let keys: Vec<(String, Vec<u8>)> = (secrets.iter())
        .map(|(id, secret)| (id.clone(), secret.expose().clone()))
        .collect();
    Sealer::new(&keys, auth.accept_unsigned_lock_ids).map_err(AuthSetupError::Keys)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn settings(principals: Vec<PrincipalSettings>) -> AuthSettings {
        AuthSettings {
            principals,
            ..AuthSettings::default()
        }
    }

    fn principal(name: &str, token: &str) -> PrincipalSettings {
        PrincipalSettings {
            name: name.into(),
            token_sha256: vec![hex::encode(Sha256::digest(token.as_bytes()))],
            tls_identity: Some(format!("{name}.workers.test")),
            name_prefixes: vec![format!("{name}/")],
            client_id_prefix: None,
            admin: false,
            acquires_per_sec: 0,
            max_held_locks: 0,
            max_sessions: 0,
        }
    }

    #[test]
    fn principals_whose_names_share_a_lease_tag_are_refused() {
        // Birthday search over 24-bit tags: a pair turns up within a few
        // thousand names.
        let mut seen = HashMap::new();
        let (a, b) = (0..100_000)
            .find_map(|i| {
                let name = format!("p{i}");
                seen.insert(LeaseTag::of(&name), name.clone())
                    .map(|other| (other, name))
            })
            .expect("a collision among 100,000 names");
        let both = settings(vec![principal(&a, "token-a"), principal(&b, "token-b")]);
        let refused = Principals::new(&both, None).err().expect("refused");
        assert!(
            matches!(&refused, AuthSetupError::SharedLeaseTag { first, second } if (first, second) == (&a, &b)),
            "{refused}"
        );
        let shown = refused.to_string();
        assert!(shown.contains(&a) && shown.contains(&b), "{shown}");
        assert!(Principals::new(&settings(vec![principal(&a, "token-a")]), None).is_ok());
    }

    fn name_of(c: Credential) -> Option<String> {
        match c {
            Credential::Principal(p) => Some(p.name.clone()),
            _ => None,
        }
    }

    #[test]
    fn tokens_and_certificates_name_their_principal() {
        let table = Principals::new(
            &settings(vec![
                principal("pay", "tok-pay"),
                principal("ship", "tok-ship"),
            ]),
            Some("the-admin-token-0123"),
        )
        .unwrap();
        let none = PeerIdentity::default();
        assert_eq!(
            name_of(table.identify(Some(b"Bearer tok-ship"), &none)),
            Some("ship".into())
        );
        assert!(matches!(
            table.identify(Some(b"Bearer the-admin-token-0123"), &none),
            Credential::AdminToken
        ));
        for bad in [
            &b"Bearer tok-nope"[..],
            b"Basic dG9rLXBheQ==",
            b"tok-pay",
            b"",
        ] {
            assert!(matches!(
                table.identify(Some(bad), &none),
                Credential::Unknown
            ));
        }
        let cert = PeerIdentity {
            names: vec!["other".into(), "pay.workers.test".into()],
        };
        assert_eq!(name_of(table.identify(None, &cert)), Some("pay".into()));
        assert!(matches!(table.identify(None, &none), Credential::None));
        // A wrong token is not excused by a good certificate.
        assert!(matches!(
            table.identify(Some(b"Bearer wrong"), &cert),
            Credential::Unknown
        ));
    }

    #[test]
    fn prefixes_client_ids_and_rates_bound_a_principal() {
        let mut p = principal("pay", "t");
        p.name_prefixes = vec!["pay/".into(), "refund:".into()];
        p.client_id_prefix = Some("pay-".into());
        p.acquires_per_sec = 2;
        let p = Principal::new(&p, None);
        p.may_lock("pay/42").unwrap();
        p.may_lock("refund:7").unwrap();
        assert!(matches!(
            p.may_lock("ship/42"),
            Err(AuthError::PermissionDenied(_))
        ));
        assert!(matches!(
            p.may_acquire("pay/1", "ship-worker"),
            Err(AuthError::PermissionDenied(_))
        ));
        p.may_acquire("pay/1", "pay-worker").unwrap();
        let past = p
            .may_acquire("pay/1", "pay-worker")
            .and_then(|_| p.may_acquire("pay/1", "pay-worker"));
        match past {
            Err(AuthError::RateLimited(RateLimited { retry_after, .. })) => {
                assert!(retry_after <= Duration::from_secs(1))
            }
            other => panic!("expected a rate limit, got {other:?}"),
        }
        let none = Principal::new(
            &PrincipalSettings {
                name_prefixes: vec![],
                ..principal("admin", "t")
            },
            None,
        );
        assert!(none.may_lock("").is_err(), "no prefixes: no names");
    }

    #[test]
    fn a_reload_keeps_what_each_principal_used_of_an_unchanged_rate() {
        let limited = |name: &str, per_sec| PrincipalSettings {
            acquires_per_sec: per_sec,
            ..principal(name, &format!("tok-{name}"))
        };
        let acquire = |table: &Principals, name: &str| {
            let bearer = format!("Bearer tok-{name}");
            match table.identify(Some(bearer.as_bytes()), &PeerIdentity::default()) {
                Credential::Principal(p) => p.may_acquire(&format!("{name}/x"), "w"),
                _ => panic!("{name} is a principal"),
            }
        };
        let limited_now = |r: Result<(), AuthError>| matches!(r, Err(AuthError::RateLimited(_)));
        let both = || settings(vec![limited("pay", 1), limited("ship", 1)]);
        let first = Principals::new(&both(), None).unwrap();
        acquire(&first, "pay").unwrap();
        assert!(limited_now(acquire(&first, "pay")));
        // Reloaded unchanged: pay's burst stays spent, ship's stays whole.
        let same = Principals::after(Some(&first), &both(), None).unwrap();
        assert!(limited_now(acquire(&same, "pay")), "a fresh burst");
        acquire(&same, "ship").unwrap();
        assert!(limited_now(acquire(&same, "ship")));
        // A new rate starts a new limiter; so does a principal removed and
        // added back.
        let faster = settings(vec![limited("pay", 2)]);
        let faster = Principals::after(Some(&same), &faster, None).unwrap();
        acquire(&faster, "pay").unwrap();
        let back = Principals::after(Some(&faster), &both(), None).unwrap();
        acquire(&back, "ship").unwrap();
    }

    #[test]
    fn new_tokens_hash_as_the_config_expects() {
        let (token, hash) = new_token();
        assert!(token.len() >= 43, "32 random bytes");
        let table = Principals::new(
            &settings(vec![PrincipalSettings {
                token_sha256: vec![hash],
                ..principal("p", "unused")
            }]),
            None,
        )
        .unwrap();
        let bearer = format!("Bearer {token}");
        assert_eq!(
            name_of(table.identify(Some(bearer.as_bytes()), &PeerIdentity::default())),
            Some("p".into())
        );
        assert_ne!(new_token().0, token);
        assert_eq!(new_key().len(), 44);
    }
}
