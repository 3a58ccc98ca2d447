//! [`Client`]: one identity (client id) talking to a lockrouter, with one
//! background renewal task for all the locks it holds.
//!
//! The top of the crate: it starts the renewal task, builds the [`Keeper`]
//! its locks share, and may use every module below; nothing imports it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::{Error, LostReason};
use crate::info::LockInfo;
use crate::keeper::Keeper;
use crate::lock::{Lock, LockHandle};
use crate::registry::Claim;
use crate::renewal::{Command, RenewalTask};
use crate::state::{Release, Shared};
use crate::transport::{AcquireArgs, LockRef, Transport};
use crate::validity;

/// How many times an acquire asks again when its answer is a grant this
/// client is still releasing (it waits for the release in between).
const ACQUIRE_ROUNDS: u32 = 3;

/// The longest wait asked of the router at once, until it refuses one as
/// too long: its default `limits.max_wait_ms`. A longer wait queues again
/// after each.
const WAIT_CHUNK: Duration = Duration::from_secs(60);

/// The shortest: a router whose cap is below it refuses every wait.
const MIN_WAIT_CHUNK: Duration = Duration::from_millis(500);

/// How an acquire asks for a name: [`Client::acquire_with`].
#[derive(Debug, Clone)]
pub struct AcquireOptions {
    ttl: Duration,
    wait: Duration,
    metadata: Option<serde_json::Value>,
    reentrant: bool,
}

impl AcquireOptions {
    /// A lock of `ttl` (at least 2 s; etcd rounds up to whole seconds),
    /// not waiting, without metadata, not re-entrant.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            wait: Duration::ZERO,
            metadata: None,
            reentrant: false,
        }
    }

    /// Waits up to `wait` for a held name (`Duration::MAX`: for as long as
    /// it takes); see [`Client::acquire_wait`].
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// A small JSON object or string recorded with the lock (at most 1 KiB
    /// by default) and shown by [`Client::inspect`] and the router's admin
    /// listings to whoever may see the lock: not a place for secrets.
    pub fn metadata(mut self, metadata: serde_json::Value) -> Self {
        self.metadata = Some(metadata);
        self
    }

    /// If this client already holds the name (and has not lost it), returns
    /// another `Lock` of that grant at once, counted: the grant is released
    /// when the last of its `Lock`s is. Without it, an acquire of a name
    /// this client holds waits its turn like any other.
    pub fn reentrant(mut self) -> Self {
        self.reentrant = true;
        self
    }
}

/// Time left before `deadline` (`None`: no end).
fn left(deadline: Option<Instant>) -> Duration {
    deadline.map_or(Duration::MAX, |d| {
        d.saturating_duration_since(Instant::now())
    })
}

/// A connection to a lockrouter under one client id. Cheap to clone: clones
/// share the connection pool, the id and the renewal task.
///
/// Every lock a client holds rides on the router's session lease for
/// (client id, TTL, shard): renewing one renews them all. Within a client
/// (and its clones) a name has one holder at a time: another acquire of a
/// name it holds waits its turn, unless it asks to be
/// [re-entrant](AcquireOptions::reentrant). Use one client id per process
/// (or per independent worker), never one shared by processes.
///
/// ```no_run
/// # async fn demo() -> Result<(), lockrouter_client::Error> {
/// use std::time::Duration;
/// use lockrouter_client::Client;
///
/// let client = Client::new("http://127.0.0.1:8080", Some("worker-7"))?;
/// match client.acquire("nightly-report", Duration::from_secs(30)).await? {
///     Some(lock) => {
///         // ... the work, sending lock.fencing_token() with every write ...
///         lock.release().await?;
///     }
///     None => println!("another worker is on it"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    /// The transport, request timeout, renewal channel and registry, which
    /// every `Lock` of this client holds too.
    keeper: Arc<Keeper>,
    client_id: String,
    margin: Option<Duration>,
    /// Numbers the locks within the renewal task.
    next_key: AtomicU64,
    /// The longest wait the router accepts at once, as far as this client
    /// knows (it shrinks when the router refuses one as too long).
    wait_chunk_ms: AtomicU64,
}

/// Settings for a [`Client`] beyond the router URL.
///
/// ```no_run
/// # fn demo() -> Result<(), lockrouter_client::Error> {
/// use std::time::Duration;
/// let client = lockrouter_client::Client::builder("http://127.0.0.1:8080")
///     .client_id("billing-worker-3")
///     .safety_margin(Duration::from_secs(2))
///     .request_timeout(Duration::from_secs(3))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    base_url: String,
    client_id: Option<String>,
    margin: Option<Duration>,
    request_timeout: Duration,
    ca_pem: Option<Vec<u8>>,
    bearer_token: Option<String>,
}

impl ClientBuilder {
    /// The bearer token of this client's principal, for a router with
    /// principals configured: sent as `Authorization: Bearer <token>` with
    /// every call.
    pub fn bearer_token(mut self, token: impl Into<String>) -> Self {
        self.bearer_token = Some(token.into());
        self
    }

    /// PEM CA certificates to trust for an `https://` router, besides the
    /// public web roots (for a router whose certificate a private CA
    /// signed).
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// The id the router knows this client by (1 to 256 bytes, no control
    /// characters). Default: a random 128-bit id.
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = Some(id.into());
        self
    }

    /// How much earlier than the router's reported expiry a lock counts as
    /// lost. Default: a tenth of the lock's TTL. Never below 100 ms.
    pub fn safety_margin(mut self, margin: Duration) -> Self {
        self.margin = Some(margin);
        self
    }

    /// How long one request may take before it counts as failed. Default
    /// 5 s; renewals also stop waiting after a third of the TTL.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Builds the client and starts its renewal task. Must be called within
    /// a tokio runtime.
    pub fn build(self) -> Result<Client, Error> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Config("a Client must be built inside a tokio runtime".into()))?;
        let mut transport = Transport::new(&self.base_url, self.ca_pem.as_deref())?;
        if let Some(token) = &self.bearer_token {
            transport = transport.with_bearer(token)?;
        }
        let client_id = match self.client_id {
            Some(id) if id.is_empty() => return Err(Error::Config("empty client id".into())),
            Some(id) => id,
            None => random_id()?,
        };
        let (commands, rx) = mpsc::unbounded_channel();
        runtime.spawn(RenewalTask::new(transport.clone(), self.request_timeout, rx).run());
        Ok(Client {
            inner: Arc::new(Inner {
                keeper: Arc::new(Keeper {
                    transport,
                    request_timeout: self.request_timeout,
                    margin: self.margin,
                    commands,
                    registry: Arc::default(),
                    holds: Arc::default(),
                }),
                client_id,
                margin: self.margin,
                next_key: AtomicU64::new(0),
                wait_chunk_ms: AtomicU64::new(WAIT_CHUNK.as_millis() as u64),
            }),
        })
    }
}

impl Client {
    /// A client of the router at `base_url` (`http://host:port` or
    /// `https://host:port`), under
    /// `client_id`, or a random id if `None`. Must be called within a tokio
    /// runtime (it starts the renewal task).
    pub fn new(base_url: &str, client_id: Option<&str>) -> Result<Self, Error> {
        let mut b = Self::builder(base_url);
        if let Some(id) = client_id {
            b = b.client_id(id);
        }
        b.build()
    }

    /// A [`ClientBuilder`] for `base_url`, to set more than the client id.
    pub fn builder(base_url: &str) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.to_string(),
            client_id: None,
            margin: None,
            request_timeout: Duration::from_secs(5),
            ca_pem: None,
            bearer_token: None,
        }
    }

    /// The id the router knows this client by.
    pub fn client_id(&self) -> &str {
        &self.inner.client_id
    }

    /// Tries once to acquire `name` for `ttl` (at least 2 s; etcd rounds
    /// up to whole seconds). `Ok(None)` means another client holds it, that
    /// others are queued for it with [`acquire_wait`](Self::acquire_wait)
    /// (the router lets no one jump the queue), or that a `Lock` of this
    /// client holds it (see [`acquire_with`](Self::acquire_with)).
    ///
    /// The returned [`Lock`] is renewed in the background until released or
    /// dropped. An acquire is idempotent for the same client id, so after a
    /// [`Error::Transport`] it is safe to call again: if the first attempt
    /// did get the lock, the retry returns that same grant. A grant this
    /// client is still releasing is never handed back, and no acquire of a
    /// name is sent while this client's release of an earlier grant of it
    /// is unanswered (a late release would end the grant the router hands
    /// back): the call first drives that release to an answer, within a
    /// request timeout (plus the wait of [`acquire_wait`](Self::acquire_wait)),
    /// and fails with [`Error::Transport`] if it cannot.
    pub async fn acquire(&self, name: &str, ttl: Duration) -> Result<Option<Lock>, Error> {
        self.acquire_with(name, AcquireOptions::new(ttl)).await
    }

    /// Acquires `name`, waiting up to `wait` for it if it is held: the
    /// router queues waiters for a name first come, first served (across
    /// router replicas) and hands the lock to the head of the queue as soon
    /// as it is released or expires. `Ok(None)` if `wait` ran out first.
    /// `Duration::MAX` waits for as long as it takes.
    ///
    /// The router caps one wait (`limits.max_wait_ms`, 60 s by default): a
    /// longer `wait` is made of several, each queuing again at the end of
    /// the line (the client learns the router's cap from its refusal). The
    /// router also caps the waiters it holds (429 `rate_limited` beyond,
    /// which [`Error::is_retryable`] accepts, and whose
    /// [`Error::retry_after`] says when to come back). Dropping the future
    /// cancels the wait: the router drops the waiter with its request.
    ///
    /// Validity counts from before the request was sent, so a long wait
    /// eats into it; when it did, the client confirms the fresh grant with
    /// one renewal before returning it.
    ///
    /// ```no_run
    /// # async fn demo(client: lockrouter_client::Client) -> Result<(), lockrouter_client::Error> {
    /// use std::time::Duration;
    /// let ttl = Duration::from_secs(30);
    /// match client.acquire_wait("nightly-report", ttl, Duration::from_secs(20)).await? {
    ///     Some(lock) => { /* our turn */ lock.release().await? }
    ///     None => println!("still held after 20 s"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn acquire_wait(
        &self,
        name: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Lock>, Error> {
        self.acquire_with(name, AcquireOptions::new(ttl).wait(wait))
            .await
    }

    /// Acquires `name` as `options` say: TTL, wait, metadata, re-entrance.
    ///
    /// One client, one holder per name: while a [`Lock`] of this client
    /// holds `name` (until it is released or dropped, even once lost),
    /// another acquire of it through this client (another task, say) waits
    /// for it as it would for another client's, first come first served,
    /// within its wait; without one it gets `Ok(None)`. Only a
    /// [`reentrant`](AcquireOptions::reentrant) acquire of a name this
    /// client holds and has not lost gets it at once, without asking the
    /// router: another `Lock` of the same grant, counted, so the grant is
    /// released when the last of its `Lock`s is released or dropped.
    ///
    /// ```no_run
    /// # async fn demo(client: lockrouter_client::Client) -> Result<(), lockrouter_client::Error> {
    /// use std::time::Duration;
    /// use lockrouter_client::AcquireOptions;
    /// let options = AcquireOptions::new(Duration::from_secs(30))
    ///     .wait(Duration::MAX)
    ///     .metadata(serde_json::json!({"job": "nightly-report"}));
    /// let lock = client.acquire_with("nightly-report", options).await?;
    /// # Ok(()) }
    /// ```
    pub async fn acquire_with(
        &self,
        name: &str,
        options: AcquireOptions,
    ) -> Result<Option<Lock>, Error> {
        let AcquireOptions {
            ttl,
            wait,
            metadata,
            reentrant,
        } = options;
        let ttl_ms = u64::try_from(ttl.as_millis())
            .ok()
            .filter(|ms| *ms > 0)
            .ok_or_else(|| Error::Config(format!("ttl {ttl:?} out of range")))?;
        let keeper = &self.inner.keeper;
        let start = Instant::now();
        // None: no end.
        let deadline = start.checked_add(wait);
        if reentrant {
            if let Some(shared) = keeper.holds.join(name) {
                return Ok(Some(Lock::new(shared, keeper.clone())));
            }
        }
        let Some(turn) = keeper.holds.take(name, deadline).await else {
            return Ok(None);
        };
        // A release of an earlier grant of this name that the router has
        // not answered may still land later; the router would answer this
        // acquire with that same grant, which the late release then ends.
        // So it is driven to an answer first, within this call's own time.
        let limit = keeper.request_timeout.saturating_add(left(deadline));
        for shared in keeper.registry.releasing(name) {
            let left = limit.saturating_sub(start.elapsed());
            if !self.settle(&shared, left).await {
                return Err(unsettled(name));
            }
        }
        let mut args = AcquireArgs {
            name,
            ttl_ms,
            wait_ms: 0,
            metadata: metadata.as_ref(),
        };
        let mut rounds = 0;
        loop {
            let left = left(deadline);
            let chunk = Duration::from_millis(self.inner.wait_chunk_ms.load(Ordering::Relaxed));
            let ask = left.min(chunk);
            args.wait_ms = u64::try_from(ask.as_millis()).unwrap_or(u64::MAX);
            match self.acquire_once(&args, ttl, ask).await {
                Ok(None) if left > ask => continue,
                Ok(None) => return Ok(None),
                // The router's cap on one wait is below the chunk: learn it.
                Err(Error::Router {
                    status: 400,
                    ref message,
                    ..
                }) if message.contains("waitMs") && ask > MIN_WAIT_CHUNK => {
                    let smaller = (ask / 2).max(MIN_WAIT_CHUNK);
                    self.inner
                        .wait_chunk_ms
                        .store(smaller.as_millis() as u64, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
                Ok(Some(Claim::Held(shared) | Claim::New(shared))) => {
                    keeper.holds.hold(turn, &shared);
                    return Ok(Some(Lock::new(shared, keeper.clone())));
                }
                // The answer overtook this client's release of the same
                // grant, which is about to free it: let the release finish,
                // then ask again.
                Ok(Some(Claim::Releasing(shared))) => {
                    rounds += 1;
                    self.settle(&shared, keeper.request_timeout).await;
                }
                // That release already got through: the router frees (has
                // freed) the grant; the next answer is a new one.
                Ok(Some(Claim::Released)) => rounds += 1,
            }
            if rounds >= ACQUIRE_ROUNDS {
                return Err(unsettled(name));
            }
        }
    }

    /// What the router tells anyone about `name`: whether it is held, by
    /// which grant and (for an admin caller, or any caller of a router
    /// with no admin guard on loopback) which client, until when, the
    /// metadata its holder attached, how many wait for it, and whether it
    /// is this client's.
    pub async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        let keeper = &self.inner.keeper;
        let mut info = keeper
            .transport
            .inspect(name, keeper.request_timeout)
            .await?;
        info.mine = info.held
            && info.fencing_token.is_some()
            && keeper.holds.holding(name) == info.fencing_token;
        Ok(info)
    }

    /// One acquire request (waiting up to `wait`), and what its grant (if
    /// any) is to this client.
    async fn acquire_once(
        &self,
        args: &AcquireArgs<'_>,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Claim>, Error> {
        let name = args.name;
        let inner = &self.inner;
        let keeper = &inner.keeper;
        let sent_at = Instant::now();
        let answer = keeper
            .transport
            .acquire(
                args,
                &inner.client_id,
                keeper.request_timeout.saturating_add(wait),
            )
            .await?;
        if !answer.acquired {
            return Ok(None);
        }
        let (Some(lock_id), Some(fencing_token), Some(expires_in_ms)) =
            (answer.lock_id, answer.fencing_token, answer.expires_in_ms)
        else {
            return Err(Error::Router {
                status: 200,
                code: "malformed_answer".into(),
                message: "acquired without lockId, fencingToken or expiresInMs".into(),
                retry_after: None,
            });
        };
        let margin = validity::margin(ttl, inner.margin);
        let mut valid_until =
            validity::valid_until(sent_at, Duration::from_millis(expires_in_ms), margin);
        let lock_ref = LockRef {
            lock_id,
            fencing_token,
        };
        if sent_at.elapsed() > margin {
            // The grant came somewhere within a long request (a wait): we
            // cannot tell when, so validity counts from the start. A renewal
            // sent now confirms the grant still stands and measures afresh.
            match self.confirm(&lock_ref, margin).await {
                Ok(Ok(fresh)) => valid_until = valid_until.max(fresh),
                Ok(Err(reason)) => {
                    return Err(Error::Lost {
                        name: name.to_string(),
                        reason,
                    })
                }
                Err(e) if valid_until <= Instant::now() => {
                    // Perhaps held, but not usable: release it, unless this
                    // client holds it already through another Lock.
                    if let Claim::New(shared) = self.claim(name, ttl, margin, lock_ref, valid_until)
                    {
                        keeper.release_in_background(&shared);
                    }
                    return Err(e);
                }
                // Still valid: the renewal task will confirm it shortly.
                Err(_) => {}
            }
        }
        let claim = self.claim(name, ttl, margin, lock_ref, valid_until);
        if let Claim::New(shared) = &claim {
            // If the task is gone the lock is never renewed and is lost when
            // its validity runs out, which `lost()` reports by the clock.
            let _ = keeper.commands.send(Command::Track(shared.clone()));
        }
        Ok(Some(claim))
    }

    /// The client's state for a grant it was just given.
    fn claim(
        &self,
        name: &str,
        ttl: Duration,
        margin: Duration,
        lock_ref: LockRef,
        valid_until: Instant,
    ) -> Claim {
        let inner = &self.inner;
        let lock_id = lock_ref.lock_id.clone();
        inner.keeper.registry.claim(&lock_id, valid_until, || {
            Shared::new(
                inner.next_key.fetch_add(1, Ordering::Relaxed),
                name,
                lock_ref,
                ttl,
                margin,
                valid_until,
                inner.keeper.registry.clone(),
            )
        })
    }

    /// Waits, at most `limit`, for a pending release to be answered, waking
    /// it from its backoff first (an acquire is about to be sent, or just
    /// reached the router, so the release likely can too), though not from
    /// a `Retry-After` the router asked of it. True once it was answered.
    async fn settle(&self, shared: &Shared, limit: Duration) -> bool {
        shared.retry_now.notify_one();
        let mut status = shared.status.subscribe();
        let settled = status.wait_for(|s| s.release != Release::Pending);
        let _ = tokio::time::timeout(limit, settled).await;
        shared.current().release != Release::Pending
    }

    /// One renewal of a fresh grant: its new validity if it still stands,
    /// or why the router says it is gone.
    async fn confirm(
        &self,
        lock: &LockRef,
        margin: Duration,
    ) -> Result<Result<Instant, LostReason>, Error> {
        let sent_at = Instant::now();
        let keeper = &self.inner.keeper;
        let answer = keeper.transport.renew(lock, keeper.request_timeout).await?;
        Ok(match (answer.renewed, answer.expires_in_ms) {
            (true, Some(ms)) => Ok(validity::valid_until(
                sent_at,
                Duration::from_millis(ms),
                margin,
            )),
            _ if answer.reason.as_deref() == Some("stolen") => Err(LostReason::Stolen),
            _ => Err(LostReason::Expired),
        })
    }

    /// Runs the future `work` returns while holding `name`, and releases the
    /// lock afterwards (as [`Lock::release`] does: waiting for the router's
    /// confirmation at most until the lock's validity ends). If the lock is
    /// lost first, the work is cancelled (dropped at its next `.await`) and
    /// the call returns [`Error::Lost`]; if another client holds the name,
    /// [`Error::NotAcquired`].
    ///
    /// Cancellation is cooperative and happens only at `.await` points, and
    /// a write already on its way to the resource cannot be called back:
    /// pass [`LockHandle::fencing_token`] with every write so the resource
    /// can reject a stale one.
    ///
    /// ```no_run
    /// # async fn demo(client: lockrouter_client::Client) -> Result<(), lockrouter_client::Error> {
    /// use std::time::Duration;
    /// let rows = client
    ///     .with_lock("process_order:42", Duration::from_secs(30), |lock| async move {
    ///         // write_order(42, lock.fencing_token()).await
    ///         lock.fencing_token()
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn with_lock<T, F, Fut>(&self, name: &str, ttl: Duration, work: F) -> Result<T, Error>
    where
        F: FnOnce(LockHandle) -> Fut,
        Fut: Future<Output = T>,
    {
        let lock = self
            .acquire(name, ttl)
            .await?
            .ok_or_else(|| Error::NotAcquired {
                name: name.to_string(),
            })?;
        let lost = lock.lost();
        let work = work(lock.handle());
        tokio::select! {
            // If both are ready, losing wins: the result cannot be trusted.
            biased;
            reason = lost => Err(Error::Lost { name: name.to_string(), reason }),
            out = work => {
                if let Err(e) = lock.release().await {
                    tracing::warn!(error = %e, name, "release after with_lock not confirmed");
                }
                Ok(out)
            }
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("client_id", &self.inner.client_id)
            .finish()
    }
}

/// The retryable error of an acquire that found this client's release of
/// an earlier grant of `name` still unanswered.
fn unsettled(name: &str) -> Error {
    Error::Transport(format!(
        "this client's earlier release of {name:?} has not got through yet"
    ))
}

/// 128 random bits from the OS: two processes sharing a client id would
/// share locks, so a guessable or colliding id is not acceptable.
fn random_id() -> Result<String, Error> {
    let mut bytes = [0u8; 16];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| Error::Config(format!("no randomness for a client id: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
