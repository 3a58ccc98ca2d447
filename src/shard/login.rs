//! An etcd user's token on one client of a shard.
//!
//! etcd-client, once it holds a user's credentials, asks for a new token by
//! itself when etcd says the one it sent is invalid (simple tokens lapse
//! after `--auth-token-ttl` seconds unused, 300 by default, and a restarted
//! member forgets them all) and sends the request again. What it does not
//! do suits a router badly: it asks for the first token when it connects,
//! which a shard that is down at start would turn into a router that does
//! not start. So clients are built without the user, and [`Login::ensure`]
//! asks for the first token before the first call that needs it, and again
//! after etcd stopped accepting the user (a changed password, a user
//! deleted, auth enabled after the router connected). A refusal is
//! remembered for [`RETRY_REFUSED_AFTER`]: every try costs etcd a bcrypt
//! hash, so calls meanwhile fail at once instead of each asking again (a
//! fixed password file is read by a reload, which connects afresh).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use etcd_client::Client;

use super::access::User;

/// How long credentials etcd refused are not sent again.
pub const RETRY_REFUSED_AFTER: Duration = Duration::from_secs(2);
/// How long an authentication etcd did not answer is not tried again: a
/// short pause, so that calls queued behind it fail at once rather than
/// each waiting for etcd in turn.
pub const RETRY_UNREACHABLE_AFTER: Duration = Duration::from_millis(250);

/// One client's standing with the shard's etcd user.
pub struct Login {
    /// The shard, for the log.
    shard: String,
    /// Whether a refusal is logged (one client of a shard says it; its
    /// members' clients would repeat it).
    loud: bool,
    /// `None`: etcd auth is not used, nothing to do.
    user: Option<User>,
    /// The client holds a token, or needs none.
    ready: AtomicBool,
    /// Serialises authentications (an async mutex: held across the
    /// Authenticate call); the last failure and when it came.
    last: tokio::sync::Mutex<Option<(Instant, LoginError)>>,
}

/// Why a client has no token. The text goes where a shard's
/// unavailability goes (answers included): it names no user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoginError {
    /// etcd answered and refused the user (wrong password, unknown user).
    #[error("etcd refused this router's credentials: {0}")]
    Refused(String),
    /// etcd did not answer the authentication.
    #[error("cannot authenticate to etcd: {0}")]
    Unreachable(String),
}

/// What an etcd answer says about authentication, from its gRPC status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthProblem {
    /// The token sent is no longer valid, or none was sent though etcd
    /// requires one: authenticate again.
    TokenLost,
    /// The user, authenticated, may not do this (its roles lack a
    /// permission on the router's prefix).
    NotPermitted,
    /// The user's credentials were refused.
    Refused,
}

impl AuthProblem {
    /// The problem an etcd status names, if it is one of these (etcd's
    /// messages are fixed strings of its API, `rpctypes`).
    pub fn of(status: &etcd_client::Error) -> Option<Self> {
        let etcd_client::Error::GRpcStatus(s) = status else {
            return None;
        };
        let msg = s.message();
        if msg.contains("authentication failed") {
            Some(Self::Refused)
        } else if msg.contains("invalid auth token")
            || msg.contains("user name is empty")
            || s.code() as i32 == tonic_codes::UNAUTHENTICATED
        {
            Some(Self::TokenLost)
        } else if msg.contains("permission denied")
            || s.code() as i32 == tonic_codes::PERMISSION_DENIED
        {
            Some(Self::NotPermitted)
        } else {
            None
        }
    }
}

impl LoginError {
    fn retry_after(&self) -> Duration {
        match self {
            Self::Refused(_) => RETRY_REFUSED_AFTER,
            Self::Unreachable(_) => RETRY_UNREACHABLE_AFTER,
        }
    }
}

impl Login {
    /// The login of a shard's main client: a refusal is logged.
    pub fn new(shard: &str, user: Option<User>) -> Self {
        Self::with(shard, user, true)
    }

    /// The login of a member's own client: as [`new`](Self::new), quiet.
    pub fn quiet(shard: &str, user: Option<User>) -> Self {
        Self::with(shard, user, false)
    }

    fn with(shard: &str, user: Option<User>, loud: bool) -> Self {
        Self {
            shard: shard.to_string(),
            loud,
            ready: AtomicBool::new(user.is_none()),
            user,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// The etcd user, if the shard has one.
    pub fn user_name(&self) -> Option<&str> {
        self.user.as_ref().map(|u| u.name.as_str())
    }

    /// Whether calls through the client carry a token (or need none).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// etcd no longer takes this client's token: the next
    /// [`ensure`](Self::ensure) authenticates again.
    pub fn forget(&self) {
        if self.user.is_some() {
            self.ready.store(false, Ordering::Release);
        }
    }

    /// Makes sure `client` holds a token for the user: authenticates if it
    /// holds none, unless that failed just before (see
    /// [`RETRY_REFUSED_AFTER`] and [`RETRY_UNREACHABLE_AFTER`]).
    pub async fn ensure(&self, client: &Client) -> Result<(), LoginError> {
        if self.is_ready() {
            return Ok(());
        }
        let Some(user) = &self.user else {
            return Ok(());
        };
        let mut last = self.last.lock().await;
        if self.is_ready() {
            return Ok(()); // another call authenticated meanwhile
        }
        if let Some((at, why)) = last.as_ref() {
            if at.elapsed() < why.retry_after() {
                return Err(why.clone());
            }
        }
        let failure = self.authenticate(client, user).await;
        let refused_before = matches!(last.as_ref(), Some((_, LoginError::Refused(_))));
        match failure {
            None => {
                if self.loud && refused_before {
                    tracing::info!(shard = %self.shard, user = %user.name, "etcd accepts this router's user again");
                }
                *last = None;
                self.ready.store(true, Ordering::Release);
                Ok(())
            }
            Some(why) => {
                let again = last.as_ref().is_some_and(|(_, w)| *w == why);
                if self.loud && !again && matches!(why, LoginError::Refused(_)) {
                    tracing::error!(
                        shard = %self.shard, user = %user.name, error = %why,
                        "etcd refuses this router's user: check shards[].username and shards[].password_file \
                         against the user in etcd; the shard is unavailable meanwhile"
                    );
                }
                *last = Some((Instant::now(), why.clone()));
                Err(why)
            }
        }
    }

    /// One Authenticate call; `None` when the client may now be used.
    async fn authenticate(&self, client: &Client, user: &User) -> Option<LoginError> {
        match client.clone().update_user(Some(user.credentials())).await {
            Ok(()) => None,
            // Auth is off on this cluster: nothing to prove. Requests go
            // without a token until etcd asks for one ("user name is
            // empty", once auth is enabled), which starts over.
            Err(etcd_client::Error::GRpcStatus(s))
                if s.message().contains("authentication is not enabled") =>
            {
                if self.loud {
                    tracing::info!(shard = %self.shard, user = %user.name, "etcd authentication is not enabled on this shard; sending requests without a token");
                }
                None
            }
            Err(e) if AuthProblem::of(&e).is_some() => Some(LoginError::Refused(e.to_string())),
            Err(e) => Some(LoginError::Unreachable(e.to_string())),
        }
    }
}

/// gRPC status codes (numbers fixed by the gRPC spec).
mod tonic_codes {
    pub const PERMISSION_DENIED: i32 = 7;
    pub const UNAUTHENTICATED: i32 = 16;
}
