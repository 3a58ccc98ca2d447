//! What one config makes of the running process, built in one place:
//! [`Generation::build`] turns [`Settings`] into the main listener's TLS,
//! the principals and the admin token, the HTTP deadlines, the access log's
//! switch, and the lock service's part ([`Active`]: the placement router,
//! limits, the lockId sealer). Start builds the first generation with it
//! and each reload the next, so a setting cannot take effect on one and not
//! on the other.
//!
//! The files a config names (certificates, lockId keys) are read before
//! the router is made, and a file that cannot be used fails the build
//! there: a bad config changes nothing, not even the shards' records (a
//! reload's router may open a migration). [`InForce`] holds the generation
//! the process runs on; [`InForce::replace`] puts the next in force whole,
//! in one swap.
//! What a config sets but only a restart changes (the listeners, the
//! runtime's threads, the bounds sized at start) is named by
//! [`start_only_changes`], so a reload can say it left them.

use std::future::Future;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::ServerConfig;

use crate::auth::{AuthSetupError, Principals};
use crate::config::{HttpTimeouts, Settings};
use crate::http::tls::TlsError;
use crate::locks::{Active, Locks};
use crate::placement::topology::Router;

/// Everything a config makes for the running process.
pub struct Generation {
    /// What the HTTP layer serves with.
    pub front: Front,
    /// The lock service's part: the router, limits and the sealer.
    pub active: Active,
}

/// What the HTTP layer reads from the generation in force: per connection
/// (TLS, the header deadline) and per request (who is calling, the
/// deadlines, whether the request gets an access log line).
pub struct Front {
    /// TLS for new connections to the main listener; `None`: plain HTTP.
    pub tls: Option<Arc<ServerConfig>>,
    /// The principals, the admin token and the admin hosts.
    pub principals: Principals,
    /// Header, body and whole-request deadlines.
    pub timeouts: HttpTimeouts,
    /// Whether each request gets an access log line (`server.access_log`).
    pub access_log: bool,
}

/// A file a config names that cannot be used: the build fails and nothing
/// changes.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A TLS file named in `[server]`.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A lockId key of `[auth]`, or principals that cannot be told apart.
    #[error(transparent)]
    Auth(#[from] AuthSetupError),
}

impl Generation {
    /// The generation `settings` describe. Reads the files they name first,
    /// then awaits `router` (start connects; a reload may open a
    /// migration), so that an unusable file fails before the router is
    /// made. `before`: the generation this one replaces (none at start),
    /// whose quota reservations it shares and whose principals' rate
    /// limiters it takes over (for each principal whose rate is unchanged).
    pub async fn build<E>(
        settings: &Settings,
        before: Option<&Current>,
        router: impl Future<Output = Result<Arc<Router>, E>>,
    ) -> Result<Self, E>
    where
        E: From<BuildError>,
    {
        let (front, sealer) = read(settings, before.map(|b| &b.front.principals))?;
        let quotas = before.map_or_else(Default::default, |b| b.locks.active().quotas.clone());
        let router = router.await?;
        Ok(Self {
            front,
            active: Active::new(settings, router, sealer, quotas),
        })
    }
}

/// What `settings` make without the shards, their files read now;
/// `before`: the principals they replace.
fn read(
    settings: &Settings,
    before: Option<&Principals>,
) -> Result<(Front, crate::token::lock_id::Sealer), BuildError> {
    let tls = crate::http::tls::load(&settings.server)?;
    let sealer = crate::auth::sealer(&settings.auth)?;
    let admin_token = settings.admin.token.as_ref().map(|t| t.expose().as_str());
    let principals = Principals::after(before, &settings.auth, admin_token)?
        .with_admin_hosts(&settings.admin.allowed_hosts);
    let front = Front {
        tls,
        principals,
        timeouts: settings.server.timeouts(),
        access_log: settings.server.access_log,
    };
    Ok((front, sealer))
}

/// The settings that differ between `old` and `new` but take effect only
/// when the router restarts: what is sized or bound once, at start.
pub fn start_only_changes(old: &Settings, new: &Settings) -> Vec<&'static str> {
    let (o, n) = (&old.server, &new.server);
    [
        ("server.listen", o.listen != n.listen),
        (
            "server.metrics_listen",
            o.metrics_listen != n.metrics_listen,
        ),
        ("server.max_in_flight", o.max_in_flight != n.max_in_flight),
        (
            "server.worker_threads",
            o.worker_threads != n.worker_threads,
        ),
        (
            "server.shutdown_grace_ms",
            o.shutdown_grace_ms != n.shutdown_grace_ms,
        ),
        (
            "admin.reload_poll_ms",
            old.admin.reload_poll_ms != new.admin.reload_poll_ms,
        ),
        (
            "limits.max_waiters",
            old.limits.max_waiters != new.limits.max_waiters,
        ),
        (
            "limits.acquires_per_client_per_sec",
            old.limits.acquires_per_client_per_sec != new.limits.acquires_per_client_per_sec,
        ),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

/// A change a reload refuses: it needs a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RestartNeeded {
    #[error("turning TLS on or off takes a restart; certificates and keys reload")]
    Tls,
    #[error(
        "etcd.prefix changes only when the router restarts (and moves every lock: see docs/design.md)"
    )]
    Prefix,
}

/// Why `new` cannot replace `old` by a reload at all: the change needs a
/// restart, and a reload that asks for it is refused.
pub fn refused_change(old: &Settings, new: &Settings) -> Option<RestartNeeded> {
    // Validation holds a certificate and its key together, so the
    // certificate alone says whether the listener speaks TLS.
    if old.server.tls_cert_file.is_some() != new.server.tls_cert_file.is_some() {
        return Some(RestartNeeded::Tls);
    }
    if old.etcd.prefix != new.etcd.prefix {
        return Some(RestartNeeded::Prefix);
    }
    None
}

/// The generation the process runs on: read by the HTTP layer, replaced
/// by each reload. Its front and its lock operations are one value,
/// swapped at once: a reader that loads it sees both halves of one
/// generation, never the front of one with the lock service of another.
pub struct InForce {
    current: ArcSwap<Current>,
}

/// A generation as it runs: what [`Generation::build`] made, its lock
/// service's part within the bounds the process sized at start.
pub struct Current {
    /// What the HTTP layer serves with.
    pub front: Front,
    /// The lock operations.
    pub locks: Locks,
}

impl InForce {
    /// The process's first generation. `per_shard`: the most acquires in
    /// flight on one shard (sized at start, as the lock service's bounds
    /// on waiters and on each clientId's rate are, from `first`).
    pub fn new(first: Generation, per_shard: usize) -> Self {
        let current = Current {
            front: first.front,
            locks: Locks::new(first.active, per_shard),
        };
        Self {
            current: ArcSwap::from_pointee(current),
        }
    }

    /// The generation in force. A request (or a connection) loads it once
    /// and works on it throughout.
    pub fn current(&self) -> Arc<Current> {
        self.current.load_full()
    }

    /// Puts `next` in force, front and lock service at once; returns what
    /// it replaced (the caller retires the old router). Reloads are
    /// serialised by their caller; the bounds `next` inherits are the
    /// process's either way.
    pub fn replace(&self, next: Generation) -> Arc<Current> {
        let locks = self.current.load().locks.next(next.active);
        self.current.swap(Arc::new(Current {
            front: next.front,
            locks,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    use crate::config::tests::MINIMAL as BASE;

    /// `BASE` with `server` lines at the top of `[server]` and `rest`
    /// appended.
    fn settings(server: &str, rest: &str) -> Settings {
        let toml = BASE.replace("[server]\n", &format!("[server]\n{server}\n"));
        Settings::from_toml(&format!("{toml}\n{rest}")).expect("valid test config")
    }

    fn key(id: &str) -> String {
        format!(
            "[[auth.lock_id_keys]]\nid = \"{id}\"\nsecret = \"{}\"\n",
            "A".repeat(44)
        )
    }

    #[test]
    fn a_config_makes_its_front_and_its_sealer() {
        let plain = settings("", "");
        let (front, _) = read(&plain, None).unwrap();
        assert!(front.tls.is_none());
        assert!(!front.principals.enabled() && !front.principals.has_admin_token());
        assert!(!front.access_log);
        assert_eq!(front.timeouts.body_read, plain.server.timeouts().body_read);

        let hash = "ab".repeat(32);
        let full = settings(
            "access_log = true\nbody_read_timeout_ms = 300\nrequest_timeout_ms = 700",
            &format!(
                "[admin]\ntoken = \"the-admin-token-0123\"\nallowed_hosts = [\"Ops.Example\"]\n{}\
                 [[auth.principals]]\nname = \"p\"\ntoken_sha256 = [\"{hash}\"]\n",
                key("k1")
            ),
        );
        let (front, sealer) = read(&full, None).unwrap();
        assert!(front.access_log);
        assert_eq!(front.timeouts.body_read, Duration::from_millis(300));
        assert_eq!(front.timeouts.request, Duration::from_millis(700));
        assert!(front.principals.enabled() && front.principals.has_admin_token());
        assert!(front.principals.admin_host_allowed("ops.example"));
        assert!(sealer.seals(), "lockIds are sealed under k1");
        assert!(!read(&plain, None).unwrap().1.seals());
    }

    #[tokio::test]
    async fn an_unusable_file_fails_the_build_before_the_router_is_made() {
        let unreadable = settings(
            "",
            "[[auth.lock_id_keys]]\nid = \"k1\"\nsecret_file = \"/nonexistent/lockid.key\"\n",
        );
        let no_cert = settings(
            "tls_cert_file = \"/nonexistent/cert.pem\"\ntls_key_file = \"/nonexistent/key.pem\"",
            "",
        );
        for (s, what) in [(unreadable, "lock_id_keys"), (no_cert, "tls_cert_file")] {
            let asked = std::sync::atomic::AtomicBool::new(false);
            let router = async {
                asked.store(true, std::sync::atomic::Ordering::Relaxed);
                Err::<Arc<Router>, BuildError>(BuildError::Auth(AuthSetupError::SharedLeaseTag {
                    first: "unreachable".into(),
                    second: "unreachable".into(),
                }))
            };
            let Err(e) = Generation::build(&s, None, router).await else {
                panic!("{what}: built");
            };
            assert!(e.to_string().contains(what), "{what}: {e}");
            // The file's own error (io, PEM) is kept as the source.
            assert!(std::error::Error::source(&e).is_some(), "{what}: {e:?}");
            assert!(!asked.into_inner(), "{what}: the router was asked for");
        }
    }

    /// A router over a shard that never answers, with the task token that
    /// stops its shard's tasks: generations need one, these tests never
    /// reach it.
    async fn unreachable_router() -> (Arc<Router>, tokio_util::sync::CancellationToken) {
        let settings = Settings::from_toml(&BASE.replace("2379", "1")).unwrap();
        let tasks = tokio_util::sync::CancellationToken::new();
        let pool = crate::placement::topology::ShardPool::new(&settings, tasks.clone());
        let router = crate::placement::serve(&settings, pool).await.unwrap();
        (router, tasks)
    }

    #[tokio::test]
    async fn a_reload_keeps_each_principals_spent_rate_and_its_reservations() {
        use sha2::{Digest, Sha256};

        let config = |per_sec: u32| {
            let hash = hex::encode(Sha256::digest(b"tok-p"));
            settings(
                "",
                &format!(
                    "{}[[auth.principals]]\nname = \"p\"\ntoken_sha256 = [\"{hash}\"]\n\
                     name_prefixes = [\"p/\"]\nacquires_per_sec = {per_sec}\n",
                    key("k1")
                ),
            )
        };
        let (router, tasks) = unreachable_router().await;
        let build = |per_sec: u32, before: Option<Arc<Current>>| {
            let router = router.clone();
            async move {
                let settings = config(per_sec);
                let router = async { Ok::<_, BuildError>(router) };
                Generation::build(&settings, before.as_deref(), router)
                    .await
                    .unwrap()
            }
        };
        let acquire = |current: &Current| {
            let none = crate::auth::PeerIdentity::default();
            match current
                .front
                .principals
                .identify(Some(b"Bearer tok-p"), &none)
            {
                crate::auth::Credential::Principal(p) => p.may_acquire("p/1", "w"),
                _ => panic!("p is a principal"),
            }
        };
        let in_force = InForce::new(build(1, None).await, 1);
        acquire(&in_force.current()).unwrap();
        assert!(acquire(&in_force.current()).is_err(), "past 1/s");
        let first = in_force.current();
        in_force.replace(build(1, Some(first.clone())).await);
        let next = in_force.current();
        assert!(acquire(&next).is_err(), "a reload gave a fresh burst");
        assert!(
            Arc::ptr_eq(&first.locks.active().quotas, &next.locks.active().quotas),
            "the quota reservations are shared"
        );
        in_force.replace(build(2, Some(next)).await);
        acquire(&in_force.current()).expect("a new rate, a new limiter");
        tasks.cancel();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_never_sees_the_front_of_one_generation_with_the_locks_of_another() {
        use std::collections::HashSet;
        use std::sync::atomic::{AtomicBool, Ordering};

        // Generation `id` carries it in both halves: the front's request
        // deadline and the lock service's longest wait, in ms.
        let config = |id: u64| {
            let toml = BASE.replace(
                "[server]\n",
                &format!("[server]\nrequest_timeout_ms = {id}\n"),
            );
            Settings::from_toml(&format!("{toml}\n[limits]\nmax_wait_ms = {id}\n")).unwrap()
        };
        let (router, tasks) = unreachable_router().await;
        let build = |id: u64| {
            let router = router.clone();
            async move {
                let settings = config(id);
                let router = async { Ok::<_, BuildError>(router) };
                Generation::build(&settings, None, router).await.unwrap()
            }
        };
        let in_force = Arc::new(InForce::new(build(10).await, 1));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = std::thread::spawn({
            let (in_force, stop) = (in_force.clone(), stop.clone());
            move || {
                let mut seen = HashSet::new();
                while !stop.load(Ordering::Relaxed) {
                    let current = in_force.current();
                    let front = current.front.timeouts.request.as_millis() as u64;
                    let locks = current.locks.active().limits.max_wait_ms;
                    assert_eq!(front, locks, "halves of two generations");
                    seen.insert(front);
                }
                seen.len()
            }
        });
        for id in 11..=500 {
            in_force.replace(build(id).await);
            tokio::task::yield_now().await;
        }
        stop.store(true, Ordering::Relaxed);
        let seen = reader
            .join()
            .expect("the reader saw one generation at a time");
        assert!(seen > 1, "the reader ran while generations were replaced");
        tasks.cancel();
    }

    #[test]
    fn what_only_a_restart_changes_is_named() {
        let old = settings("", "");
        assert!(start_only_changes(&old, &old).is_empty());
        let new = settings(
            "metrics_listen = \"127.0.0.1:9090\"\nworker_threads = 1\nshutdown_grace_ms = 5\n\
             max_in_flight = 100\naccess_log = true\nbody_read_timeout_ms = 300",
            "[admin]\nreload_poll_ms = 0\ntoken = \"the-admin-token-0123\"\n\
             [limits]\nmax_waiters = 1\nacquires_per_client_per_sec = 0\nmax_wait_ms = 10\n",
        );
        assert_eq!(
            start_only_changes(&old, &new),
            [
                "server.metrics_listen",
                "server.max_in_flight",
                "server.worker_threads",
                "server.shutdown_grace_ms",
                "admin.reload_poll_ms",
                "limits.max_waiters",
                "limits.acquires_per_client_per_sec",
            ],
            "the access log, deadlines, admin token and other limits reload"
        );
    }

    #[test]
    fn turning_tls_on_or_moving_the_prefix_refuses_a_reload() {
        let plain = settings("", "");
        let tls = settings("tls_cert_file = \"/c.pem\"\ntls_key_file = \"/k.pem\"", "");
        let rotated = settings(
            "tls_cert_file = \"/c2.pem\"\ntls_key_file = \"/k2.pem\"",
            "",
        );
        let moved = Settings::from_toml(&BASE.replace("/lockrouter", "/elsewhere")).unwrap();
        assert_eq!(refused_change(&plain, &tls), Some(RestartNeeded::Tls));
        assert_eq!(refused_change(&tls, &plain), Some(RestartNeeded::Tls));
        assert_eq!(refused_change(&plain, &moved), Some(RestartNeeded::Prefix));
        assert!(RestartNeeded::Tls.to_string().contains("TLS"));
        assert!(RestartNeeded::Prefix.to_string().contains("etcd.prefix"));
        assert_eq!(refused_change(&tls, &rotated), None, "certificates reload");
        assert_eq!(
            refused_change(&plain, &settings("access_log = true", "")),
            None
        );
    }
}
