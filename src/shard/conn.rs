//! One connection to one etcd cluster: every RPC lockrouter makes goes
//! through [`EtcdConn::call`], which applies the shard's deadline, classifies
//! errors, records metrics and keeps the shard's up/down flag current.
//! Cheap to clone (the etcd client is a handle to a shared channel).
//!
//! Every client it opens (the balanced channel, each member's own) uses
//! the shard's [`Access`]: its TLS, and its etcd user, whose token each
//! client gets through a [`Login`] before it is used.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use etcd_client::{Client, Txn, TxnResponse};
use futures::future::BoxFuture;

use super::access::{Access, FileProblem};
use super::login::{AuthProblem, Login};
use super::wire::Wire;
use crate::metrics as m;

/// How long an idempotent request (a read, a barrier) waits for its first
/// answer before it also goes to other members: a member that went silent
/// costs such a request this much, not the shard's whole deadline.
pub const HEDGE_AFTER: Duration = Duration::from_millis(100);
/// Members a hedged request also goes to (besides the first try).
const HEDGE_FANOUT: usize = 2;
/// How often each member of a shard with several is probed.
const MEMBER_PROBE_EVERY: Duration = Duration::from_millis(250);
/// A member whose probe takes longer is taken out of rotation until a
/// probe answers in time again.
const MEMBER_PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// The first of `tries` that succeeds, or the last failure when none
/// does (`tries` holds at least one).
async fn first_success<T, E>(
    mut tries: futures::stream::FuturesUnordered<impl Future<Output = Result<T, E>>>,
) -> Result<T, E> {
    use futures::stream::StreamExt;
    let mut last = None;
    while let Some(r) = tries.next().await {
        match r {
            Ok(v) => return Ok(v),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one try"))
}

/// What an etcd call's error says, authentication aside
/// ([`AuthProblem`], looked at first by whoever asks).
#[derive(PartialEq)]
enum Failure {
    LeaseNotFound,
    /// Unreachable, no leader, past a deadline: retry later.
    Unavailable,
    /// An answer etcd gave that retrying would not change.
    Refused,
}

fn failure(e: &etcd_client::Error) -> Failure {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(s) if s.message().contains("lease not found") => Failure::LeaseNotFound,
        E::LeaseKeepAliveError(msg) if msg.contains("lease not found") => Failure::LeaseNotFound,
        E::GRpcStatus(s) if tonic_code::UNAVAILABLE_CODES.contains(&(s.code() as i32)) => {
            Failure::Unavailable
        }
        E::TransportError(_) | E::IoError(_) | E::LeaseKeepAliveError(_) | E::WatchError(_) => {
            Failure::Unavailable
        }
        _ => Failure::Refused,
    }
}

/// Whether a call that failed with `e` may be answered by another member:
/// it was unavailable ([`failure`]). An answer (a lease not found, a
/// refused token, a request etcd rejects) would be the same from any
/// member, and so would etcd's "too many requests" (the leader's backlog
/// of entries not yet applied, which every member's requests join):
/// sending that one to more members would only add to the backlog.
fn another_member_may_answer(e: &etcd_client::Error) -> bool {
    let backlog = matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() as i32 == tonic_code::RESOURCE_EXHAUSTED);
    AuthProblem::of(e).is_none() && failure(e) == Failure::Unavailable && !backlog
}

/// [`EtcdConn::call_hedged`]'s tries: `make(balanced)` first; when it has
/// not answered within [`HEDGE_AFTER`] (or failed in a way another member
/// may not), `make` of up to [`HEDGE_FANOUT`] of `members()` (each a
/// different member, by index), and of the next one each time a try fails
/// that way while others wait. The first success counts, and so does an
/// answer another member would give the same; else the last failure.
/// `failed` hears of each try that failed and was not the answer.
async fn hedge<C, T, Fut>(
    balanced: C,
    members: impl FnOnce() -> Vec<(usize, C)>,
    make: impl Fn(C) -> Fut,
    failed: impl Fn(Option<usize>, &etcd_client::Error),
) -> Result<T, etcd_client::Error>
where
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    use futures::stream::{FuturesUnordered, StreamExt};
    let tried = |member: Option<usize>, client: C| {
        let call = make(client);
        async move { (member, call.await) }
    };
    let mut tries = FuturesUnordered::new();
    tries.push(tried(None, balanced));
    let mut last = match tokio::time::timeout(HEDGE_AFTER, tries.next()).await {
        Ok(Some((_, Ok(v)))) => return Ok(v),
        Ok(Some((_, Err(e)))) if !another_member_may_answer(&e) => return Err(e),
        Ok(Some((member, Err(e)))) => {
            failed(member, &e);
            Some(e)
        }
        _ => None,
    };
    let mut spare = members().into_iter();
    for (i, client) in spare.by_ref().take(HEDGE_FANOUT) {
        tries.push(tried(Some(i), client));
    }
    while let Some((member, r)) = tries.next().await {
        match r {
            Ok(v) => return Ok(v),
            Err(e) if !another_member_may_answer(&e) => return Err(e),
            Err(e) => {
                failed(member, &e);
                if let Some((i, client)) = spare.next() {
                    tries.push(tried(Some(i), client));
                }
                last = Some(e);
            }
        }
    }
    Err(last.expect("a try failed"))
}

/// Moves the member `leader` (an index) to the front of `members`, the
/// others keeping their order. Hedges go to the leader first: a write (a
/// barrier, a move of the grant cut-off) is applied only once the leader
/// has it, and a follower cut off from the leader drops what it forwards
/// to it, so a write hedged to followers alone waits out its deadline
/// even once the cut heals (seen: a move of the cut-off whose three tries
/// all went to followers, the leader left out); a linearizable read waits
/// for the leader's read index too.
fn leader_first<C>(members: &mut [(usize, C)], leader: Option<usize>) {
    if let Some(at) = leader.and_then(|l| members.iter().position(|(i, _)| *i == l)) {
        members[..=at].rotate_right(1);
    }
}

/// [`Inner::leader`] when no member is known to lead.
const NO_LEADER: usize = usize::MAX;

/// Which member leads, of members that can serve (by [`serving`]), from
/// each one's own id and the leader it knows: the one whose id is the
/// leader's.
fn leader_of(
    ids: &[Option<u64>],
    statuses: &[Option<(u64, u64)>],
    serving: &[bool],
) -> Option<usize> {
    (0..ids.len()).find(|&i| {
        serving[i] && matches!((ids[i], statuses[i]), (Some(id), Some((leader, _))) if id == leader)
    })
}

/// Which members can serve, from each one's `(leader, raft term)` (`None`:
/// no answer in time): those that know a leader at the newest term any
/// member knows a leader at. A member cut off from its peers either knows
/// no leader (a follower past its election timeout, or a candidate whose
/// term keeps rising as it campaigns alone, which is why the newest term
/// is taken only among members that know a leader) or still follows, or
/// is, the leader of an older term (a minority leader before it steps
/// down).
fn serving(statuses: &[Option<(u64, u64)>]) -> Vec<bool> {
    let newest = statuses
        .iter()
        .flatten()
        .filter(|(leader, _)| *leader != 0)
        .map(|(_, term)| *term)
        .max();
    statuses
        .iter()
        .map(|s| matches!((s, newest), (Some((leader, term)), Some(n)) if *leader != 0 && *term == n))
        .collect()
}

/// Why an etcd call failed, as far as callers need to know.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EtcdError {
    /// Unreachable, no leader, or past the deadline: retry later.
    #[error("shard {shard} unavailable: {detail}")]
    Unavailable { shard: String, detail: String },
    /// The lease named in the request no longer exists.
    #[error("lease not found")]
    LeaseNotFound,
    /// Anything else etcd refused; a bug or a misconfigured cluster.
    #[error("etcd error on shard {shard}: {detail}")]
    Other { shard: String, detail: String },
}

/// A shard's etcd client could not be built: a malformed endpoint that
/// passed validation, or TLS files that no longer make a client config.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Prints as etcd-client's error, which it keeps as its source.
    #[error(transparent)]
    Etcd(#[from] etcd_client::Error),
    #[error("shards[].{setting}: {problem}")]
    Tls {
        setting: &'static str,
        #[source]
        problem: FileProblem,
    },
}

struct Inner {
    shard: String,
    metrics: m::ShardMetrics,
    client: Client,
    /// The members' connections under every client.
    wire: Wire,
    /// `client`'s token for the shard's etcd user.
    login: Login,
    /// One single-endpoint client per member, to probe members one by one
    /// (only for shards with several endpoints).
    members: Vec<Member>,
    /// Members currently in `client`'s rotation (the wire's). A call sent
    /// to a dead member waits out its deadline, so dead ones are taken out
    /// until they answer.
    in_rotation: Mutex<HashSet<String>>,
    /// Round-robin cursor over `members` for hedges and keepalive streams.
    next_member: AtomicUsize,
    /// Index in `members` of the member that said it leads at the newest
    /// term at the last probe ([`NO_LEADER`]: none known).
    leader: AtomicUsize,
    timeout: Duration,
    /// False after a call failed for unavailability, until a probe succeeds.
    up: AtomicBool,
    /// The shard's unavailability was logged since it was last up (or
    /// since the connection was made: a shard never reached is logged
    /// too, with why).
    down_logged: AtomicBool,
    /// The members' etcd version was checked once (see `check_version`).
    version_checked: AtomicBool,
}

/// One member's own client.
struct Member {
    endpoint: String,
    client: Client,
    /// Its token; a member whose client has none is not handed out.
    login: Login,
}

#[derive(Clone)]
pub struct EtcdConn {
    inner: Arc<Inner>,
}

impl EtcdConn {
    /// Builds the clients; no connection is made (nor token asked for)
    /// until the first call, so a shard that is down at start-up does not
    /// stop the router. Every client goes out on one [`Wire`]: one
    /// connection per member, shared by the balanced client and each
    /// member's own.
    pub async fn connect(
        shard: &str,
        access: &Access,
        timeout: Duration,
        connect_timeout: Duration,
    ) -> Result<Self, ClientError> {
        let endpoints = &access.endpoints;
        let tls = access
            .tls_config()
            .map_err(|(setting, problem)| ClientError::Tls { setting, problem })?;
        let wire = Wire::new(shard, endpoints, tls, connect_timeout)?;
        let user = || access.user().cloned();
        let client = wire.client(access.options()).await?;
        let mut members = Vec::new();
        if endpoints.len() > 1 {
            for (i, ep) in endpoints.iter().enumerate() {
                members.push(Member {
                    endpoint: ep.clone(),
                    client: wire.member(i).client(access.options()).await?,
                    login: Login::quiet(shard, user()),
                });
            }
        }
        m::shard_up(shard, false);
        Ok(Self {
            inner: Arc::new(Inner {
                shard: shard.to_string(),
                metrics: m::ShardMetrics::new(shard),
                client,
                wire,
                login: Login::new(shard, user()),
                members,
                in_rotation: Mutex::new(endpoints.iter().cloned().collect()),
                next_member: AtomicUsize::new(0),
                leader: AtomicUsize::new(NO_LEADER),
                timeout,
                up: AtomicBool::new(false),
                down_logged: AtomicBool::new(false),
                version_checked: AtomicBool::new(false),
            }),
        }
        .watching_members())
    }

    /// With several members, probes them every [`MEMBER_PROBE_EVERY`] for
    /// as long as the connection lives, so that a member that goes silent
    /// leaves the rotation within about a second.
    fn watching_members(self) -> Self {
        if self.inner.members.len() > 1 {
            let weak: Weak<Inner> = Arc::downgrade(&self.inner);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(MEMBER_PROBE_EVERY).await;
                    let Some(inner) = weak.upgrade() else { return };
                    EtcdConn { inner }.check_members().await;
                }
            });
        }
        self
    }

    /// A member's own client, in rotation and holding a token if the
    /// shard has a user, taken in turn; `avoid` (an index returned before)
    /// is skipped when another is in rotation. `None` for a shard with one
    /// endpoint, or when no member's client can be used.
    pub fn member(&self, avoid: Option<usize>) -> Option<(usize, Client)> {
        let in_turn = self.members_in_turn();
        let pick = (in_turn.iter())
            .position(|(i, _)| Some(*i) != avoid)
            .unwrap_or(0);
        in_turn.into_iter().nth(pick)
    }

    /// Every member's own client that is in rotation and holds a token if
    /// the shard has a user, each once, starting from the next in turn
    /// (so that callers spread over them). Empty for a shard with one
    /// endpoint.
    fn members_in_turn(&self) -> Vec<(usize, Client)> {
        let members = &self.inner.members;
        if members.is_empty() {
            return Vec::new();
        }
        let live = self.inner.in_rotation.lock().expect("members lock");
        let start = self.inner.next_member.fetch_add(1, Ordering::Relaxed);
        (0..members.len())
            .map(|k| (start + k) % members.len())
            .filter(|&i| live.contains(&members[i].endpoint) && members[i].login.is_ready())
            .map(|i| (i, members[i].client.clone()))
            .collect()
    }

    /// The member that led at the last probe, if it is in rotation and
    /// can be used (shards with several endpoints only).
    pub fn leader(&self) -> Option<usize> {
        let i = self.inner.leader.load(Ordering::Relaxed);
        let member = self.inner.members.get(i)?;
        let live = self.inner.in_rotation.lock().expect("members lock");
        (live.contains(&member.endpoint) && member.login.is_ready()).then_some(i)
    }

    /// Sets the member the probes found leading (tests of what follows it).
    #[cfg(test)]
    pub fn set_leader(&self, leader: Option<usize>) {
        self.inner
            .leader
            .store(leader.unwrap_or(NO_LEADER), Ordering::Relaxed);
    }

    /// A member's own client for a keepalive stream: the leader's unless it
    /// is `avoid` (etcd answers keepalives only on the leader: a follower
    /// forwards each one to it in an HTTP request of its own, which cost
    /// three 3.5.16 members about 230 µs of CPU per keepalive against about
    /// 9 sent to the leader, and carries one stream's keepalives one at a
    /// time), else [`EtcdConn::member`]'s.
    pub fn keepalive_member(&self, avoid: Option<usize>) -> Option<(usize, Client)> {
        match self.leader().filter(|&i| Some(i) != avoid) {
            Some(i) => Some((i, self.inner.members[i].client.clone())),
            None => self.member(avoid),
        }
    }

    /// Runs an RPC that may safely run twice (a read, a barrier put) under
    /// the shard's deadline, hedged: when the balanced channel has not
    /// answered within [`HEDGE_AFTER`] (or failed at once: its connection
    /// just dropped), the same request also goes to up to
    /// [`HEDGE_FANOUT`] members in rotation, each a different one and the
    /// leader first ([`leader_first`]), and the first success counts. A
    /// try that fails while others wait is replaced by one to a member in
    /// rotation not tried yet, so a member that fails fast never leaves the
    /// request waiting on a silent one. A silent member then costs the
    /// request [`HEDGE_AFTER`], not the deadline. An answer that another
    /// member would give the same ([`another_member_may_answer`]) ends the
    /// request at once. The tries go to the heap, as every call does
    /// ([`call`](Self::call)).
    pub async fn call_hedged<T, F, Fut>(&self, rpc: &'static str, make: F) -> Result<T, EtcdError>
    where
        F: Fn(Client) -> Fut + Send + Sync,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send,
        T: Send,
    {
        let shard = self.inner.shard.as_str();
        let balanced = self.inner.client.clone();
        let members = || {
            let mut in_turn = self.members_in_turn();
            leader_first(&mut in_turn, self.leader());
            if !in_turn.is_empty() {
                self.inner.metrics.hedged(rpc);
            }
            in_turn
        };
        let hedged = hedge(balanced, members, &make, |member, e| {
            let member = member.map(|i| self.inner.members[i].endpoint.as_str());
            tracing::debug!(shard, rpc, ?member, error = %e, "a hedged try failed");
        });
        self.call(rpc, hedged).await
    }

    /// A txn that may safely run twice (a read, a barrier put), hedged as
    /// [`call_hedged`](Self::call_hedged) is.
    pub async fn txn_hedged(&self, txn: Txn) -> Result<TxnResponse, EtcdError> {
        self.call_hedged("Txn", |client| {
            let txn = txn.clone();
            async move { client.kv_client().txn(txn).await }
        })
        .await
    }

    /// A read-only txn sent at once through the balanced channel and to
    /// every member whose client can be used, under the shard's deadline;
    /// the first answer counts. For the rare read that must be answered if
    /// any member can answer it: what a grant txn cut off by the grant
    /// cut-off did ([`Shard::read_name_settled`](super::Shard::read_name_settled)).
    /// A member that lost its leader for a while may hold linearizable
    /// reads for seconds after it is back (etcd 3.4 waits out its whole
    /// read-index timeout), while the leader answers them at once.
    pub async fn txn_everywhere(&self, txn: Txn) -> Result<TxnResponse, EtcdError> {
        use futures::stream::FuturesUnordered;
        let send = |client: Client| {
            let txn = txn.clone();
            async move { client.kv_client().txn(txn).await }
        };
        let everywhere = async {
            let tries: FuturesUnordered<_> = (self.inner.members.iter())
                .filter(|member| member.login.is_ready())
                .map(|member| send(member.client.clone()))
                .collect();
            tries.push(send(self.inner.client.clone()));
            if tries.len() > 1 {
                self.inner.metrics.hedged("Txn");
            }
            first_success(tries).await
        };
        self.call("Txn", everywhere).await
    }

    pub fn shard(&self) -> &str {
        &self.inner.shard
    }

    /// The shard's hot metric series.
    pub fn metrics(&self) -> &m::ShardMetrics {
        &self.inner.metrics
    }

    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    pub fn is_up(&self) -> bool {
        self.inner.up.load(Ordering::Relaxed)
    }

    pub fn set_up(&self, up: bool) {
        self.set_state(up, "");
    }

    /// Marks the shard down: `why` (what failed) is logged.
    pub fn set_down(&self, why: &str) {
        self.set_state(false, why);
    }

    /// Like [`set_up`](Self::set_up); `why` (what failed) is logged when
    /// the shard goes down.
    fn set_state(&self, up: bool, why: &str) {
        let was = self.inner.up.swap(up, Ordering::Relaxed);
        if was != up {
            m::shard_up(&self.inner.shard, up);
        }
        if up && !was {
            self.inner.down_logged.store(false, Ordering::Relaxed);
            tracing::info!(shard = %self.inner.shard, "shard is reachable");
        } else if !up && !self.inner.down_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(shard = %self.inner.shard, error = %why, "shard is unavailable");
        }
    }

    /// Probes each member; takes members that cannot serve out of the
    /// balanced channel (never the last one) and puts back those that can
    /// again. A member serves if it answers in time, knows a leader, and
    /// is at the newest raft term any member reports: a member cut off
    /// from its peers still answers its clients, but it knows no leader
    /// (a follower past its election timeout, a leader that stepped down
    /// for lack of quorum), or still believes in a leader of an older term
    /// (a minority leader before it steps down), and every write or
    /// linearizable read sent to it waits out the deadline. When no member
    /// serves (an election), the rotation is left as it is.
    pub async fn check_members(&self) {
        let timeout = self.inner.timeout.min(MEMBER_PROBE_TIMEOUT);
        let probes = self.inner.members.iter().map(|member| async move {
            // A member whose client cannot get a token cannot serve.
            let probe = async {
                member
                    .login
                    .ensure(&member.client)
                    .await
                    .map_err(|e| e.to_string())?;
                let status = member.client.maintenance_client().status().await;
                status.map_err(|e| e.to_string())
            };
            let answer = tokio::time::timeout(timeout, probe).await;
            let answer = answer
                .unwrap_or_else(|_| Err(format!("no answer within {} ms", timeout.as_millis())));
            answer.map_err(|why| format!("{}: {why}", member.endpoint))
        });
        let answers = futures::future::join_all(probes).await;
        let statuses: Vec<Option<(u64, u64)>> = (answers.iter())
            .map(|a| a.as_ref().ok().map(|s| (s.leader(), s.raft_term())))
            .collect();
        let ids: Vec<Option<u64>> = (answers.iter())
            .map(|a| a.as_ref().ok()?.header().map(|h| h.member_id()))
            .collect();
        let serving = serving(&statuses);
        let leader = leader_of(&ids, &statuses, &serving);
        self.inner
            .leader
            .store(leader.unwrap_or(NO_LEADER), Ordering::Relaxed);
        let why: Vec<&str> = answers
            .iter()
            .filter_map(|a| a.as_ref().err())
            .map(String::as_str)
            .collect();
        if why.len() == answers.len() {
            // Down until a call succeeds (the monitor's next probe): every
            // call would wait out its deadline. Not in an election (members
            // answer, none knows a leader): calls wait for the new leader.
            self.set_down(&format!("no member answers ({})", why.join("; ")));
        }
        if !serving.iter().any(|ok| *ok) {
            return;
        }
        for (i, (member, ok)) in self.inner.members.iter().zip(serving).enumerate() {
            let ep = &member.endpoint;
            let change = {
                let mut live = self.inner.in_rotation.lock().expect("members lock");
                if ok && live.insert(ep.clone()) {
                    Some(true)
                } else if !ok && live.len() > 1 && live.remove(ep) {
                    Some(false)
                } else {
                    None
                }
            };
            match change {
                Some(true) => {
                    tracing::info!(shard = %self.inner.shard, member = %ep, "member answers again");
                    self.inner.wire.set_serving(i, true);
                }
                Some(false) => {
                    tracing::warn!(shard = %self.inner.shard, member = %ep, "member does not answer, or is cut off from its leader; sending to the others");
                    self.inner.wire.set_serving(i, false);
                }
                None => {}
            }
        }
    }

    /// Once per connection: asks etcd its version and warns if it is a
    /// release with known lease bugs (lockrouter defends against them, but
    /// operators should upgrade) or one etcd itself warns against.
    pub async fn check_version(&self) {
        if self.inner.version_checked.load(Ordering::Relaxed) {
            return;
        }
        let mut m = self.inner.client.maintenance_client();
        let status = async {
            self.inner.login.ensure(&self.inner.client).await.ok()?;
            m.status().await.ok()
        };
        let Ok(Some(status)) = tokio::time::timeout(self.inner.timeout, status).await else {
            return; // asked again next round
        };
        self.inner.version_checked.store(true, Ordering::Relaxed);
        let shard = &self.inner.shard;
        let version = status.version();
        match release_risk(version) {
            Some(Risk::Unsafe) => tracing::error!(
                %shard, version,
                "this etcd release has a data inconsistency bug (etcd 3.5.0 to 3.5.2): upgrade to 3.5.3 or later"
            ),
            Some(Risk::StaleLeaderRevokes) => tracing::warn!(
                %shard, version,
                "this etcd release lets a paused old leader revoke leases renewed through the new one \
                 (etcd issues 12528, 15247; fixed in 3.4.31 and 3.5.13): lockrouter's lock-delay \
                 keeps grants safe, but upgrade etcd"
            ),
            None => tracing::info!(%shard, version, "etcd version"),
        }
    }

    pub fn unavailable(&self, detail: impl Into<String>) -> EtcdError {
        EtcdError::Unavailable {
            shard: self.inner.shard.clone(),
            detail: detail.into(),
        }
    }

    /// Runs one etcd RPC under the shard's deadline, or the request's if
    /// that comes first (see [`under_deadline`](crate::task::under_deadline)).
    /// A call cut short by the request's deadline says nothing of the
    /// shard: it does not mark it down.
    ///
    /// The call goes to the heap: etcd-client's futures are kilobytes
    /// (10 KB or more for a txn), and kept inline they would make every
    /// future that may call etcd that large, the acquire handler's
    /// included, copied whole each time it is moved, on every request
    /// (docs/benchmarks.md, "Futures on the heap").
    pub fn call<'a, T, F>(
        &'a self,
        rpc: &'static str,
        fut: F,
    ) -> BoxFuture<'a, Result<T, EtcdError>>
    where
        F: Future<Output = Result<T, etcd_client::Error>> + Send + 'a,
        T: Send + 'a,
    {
        Box::pin(self.call_inline(rpc, fut))
    }

    async fn call_inline<T, F>(&self, rpc: &'static str, fut: F) -> Result<T, EtcdError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        let started = Instant::now();
        let left = crate::task::request_deadline().map(|d| d.saturating_duration_since(started));
        let (limit, by_request) = match left {
            Some(left) if left < self.inner.timeout => (left, true),
            _ => (self.inner.timeout, false),
        };
        // The token first (etcd-client reads it when the call is sent).
        let call = async {
            if let Err(e) = self.inner.login.ensure(&self.inner.client).await {
                return Err(self.unavailable(e.to_string()));
            }
            fut.await.map_err(|e| self.classify(e))
        };
        let result = match tokio::time::timeout(limit, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e),
            Err(_) if by_request => {
                self.inner
                    .metrics
                    .etcd_rpc(rpc, "deadline", started.elapsed());
                return Err(self.unavailable("the request's deadline passed"));
            }
            Err(_) => Err(self.unavailable(format!(
                "no answer within {} ms",
                self.inner.timeout.as_millis()
            ))),
        };
        let outcome = match &result {
            Ok(_) => "ok",
            Err(EtcdError::LeaseNotFound) => "lease_not_found",
            Err(EtcdError::Unavailable { .. }) => "unavailable",
            Err(EtcdError::Other { .. }) => "error",
        };
        self.inner.metrics.etcd_rpc(rpc, outcome, started.elapsed());
        match &result {
            Err(EtcdError::Unavailable { detail, .. }) => {
                tracing::debug!(shard = %self.inner.shard, rpc, %detail, "etcd call failed");
                // With several members, a call's failure is as likely its
                // member's (silent, dead, cut off) as the shard's: the
                // member probes say when no member serves, and the
                // monitor's probe (hedged) when none answers it.
                if self.inner.members.is_empty() {
                    self.set_state(false, detail);
                }
            }
            // An answer proves the shard reachable.
            _ => self.set_up(true),
        }
        result
    }

    pub fn classify(&self, e: etcd_client::Error) -> EtcdError {
        use etcd_client::Error as E;
        if let Some(problem) = AuthProblem::of(&e) {
            return self.refused(problem, e);
        }
        match (failure(&e), e) {
            (Failure::LeaseNotFound, _) => EtcdError::LeaseNotFound,
            (Failure::Unavailable, E::GRpcStatus(s)) => self.unavailable(s.message().to_string()),
            (Failure::Unavailable, E::LeaseKeepAliveError(msg) | E::WatchError(msg)) => {
                self.unavailable(msg)
            }
            (Failure::Unavailable, other) => self.unavailable(match other {
                E::TransportError(t) => t.to_string(),
                E::IoError(io) => io.to_string(),
                other => other.to_string(),
            }),
            (Failure::Refused, other) => EtcdError::Other {
                shard: self.inner.shard.clone(),
                detail: other.to_string(),
            },
        }
    }
}

impl EtcdConn {
    /// An answer about authentication: the shard cannot be used as this
    /// router is configured for it, which is unavailability (each call
    /// says why, and the shard is marked down) rather than a bug. A lost
    /// token is asked for again by the next call (every client: the
    /// members' share the user).
    fn refused(&self, problem: AuthProblem, e: etcd_client::Error) -> EtcdError {
        let has_user = self.inner.login.user_name().is_some();
        let detail = match problem {
            AuthProblem::TokenLost if has_user => {
                self.forget_tokens();
                format!("etcd no longer accepts this router's token: {e}")
            }
            AuthProblem::TokenLost => format!(
                "etcd requires authentication: set shards[].username and shards[].password_file: {e}"
            ),
            AuthProblem::Refused => {
                self.forget_tokens();
                format!("etcd refused this router's credentials: {e}")
            }
            AuthProblem::NotPermitted => format!(
                "etcd does not permit this router's user: grant its role readwrite on the keys under etcd.prefix: {e}"
            ),
        };
        self.unavailable(detail)
    }

    /// Every client asks for a new token before its next use.
    fn forget_tokens(&self) {
        self.inner.login.forget();
        for member in &self.inner.members {
            member.login.forget();
        }
    }
}

/// What is known to be wrong with an etcd release.
#[derive(Debug, PartialEq, Eq)]
pub enum Risk {
    /// 3.5.0 to 3.5.2: etcd itself warns of data inconsistency.
    Unsafe,
    /// Before 3.4.31 / 3.5.13: a resumed old leader can revoke leases.
    StaleLeaderRevokes,
}

/// The known risk of etcd `version` ("3.4.23"), if any; `None` for
/// releases with the fixes, and for versions it cannot read.
pub fn release_risk(version: &str) -> Option<Risk> {
    let mut parts = version
        .split(['.', '-', '+'])
        .map(|p| p.parse::<u32>().ok());
    let (major, minor, patch) = (parts.next()??, parts.next()??, parts.next()??);
    match (major, minor) {
        (3, 5) if patch <= 2 => Some(Risk::Unsafe),
        (3, 5) if patch < 13 => Some(Risk::StaleLeaderRevokes),
        (3, 4) if patch < 31 => Some(Risk::StaleLeaderRevokes),
        (3, m) if m < 4 => Some(Risk::StaleLeaderRevokes),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How each member (by index) answers a hedged try in these tests.
    #[derive(Clone, Copy)]
    enum Acts {
        /// Never answers (its connection silent).
        Silent,
        /// Fails at once as a member whose connection dropped does.
        FailsFast,
        /// Answers with its index after 5 ms.
        Answers,
        /// Answers that the lease is gone (any member would).
        LeaseGone,
        /// Answers etcd's "too many requests" (the leader's backlog, which
        /// any member's request would join).
        TooMany,
    }

    /// `hedge` over a balanced try acting as `balanced` and members acting
    /// as `members`; the answer and when it came (the clock is paused).
    async fn hedged(balanced: Acts, members: &[Acts]) -> (Result<usize, String>, Duration) {
        let started = tokio::time::Instant::now();
        let all: Vec<(usize, (usize, Acts))> = (members.iter().copied().enumerate())
            .map(|(i, acts)| (i, (i, acts)))
            .collect();
        let make = |(i, acts): (usize, Acts)| async move {
            match acts {
                Acts::Silent => std::future::pending().await,
                Acts::FailsFast => Err(etcd_client::Error::IoError(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    format!("member {i}: broken pipe"),
                ))),
                Acts::Answers => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Ok(i)
                }
                Acts::LeaseGone => Err(etcd_client::Error::GRpcStatus(tonic::Status::not_found(
                    "etcdserver: requested lease not found",
                ))),
                Acts::TooMany => Err(etcd_client::Error::GRpcStatus(
                    tonic::Status::resource_exhausted("etcdserver: too many requests"),
                )),
            }
        };
        let call = hedge((usize::MAX, balanced), || all, make, |_, _| {});
        // A call left waiting on silent members answers nothing, ever.
        let answer = match tokio::time::timeout(Duration::from_secs(60), call).await {
            Ok(answer) => answer.map_err(|e| e.to_string()),
            Err(_) => Err("never answered".into()),
        };
        (answer, started.elapsed())
    }

    #[test]
    fn hedges_go_to_the_leader_first() {
        let order = |leader: Option<usize>| {
            let mut members = vec![(2, ()), (0, ()), (1, ())];
            leader_first(&mut members, leader);
            members.iter().map(|(i, _)| *i).collect::<Vec<_>>()
        };
        assert_eq!(order(Some(1)), [1, 2, 0]);
        assert_eq!(order(Some(0)), [0, 2, 1]);
        assert_eq!(order(Some(2)), [2, 0, 1]);
        // No leader known, or one out of rotation: the turn as it was.
        assert_eq!(order(None), [2, 0, 1]);
        assert_eq!(order(Some(3)), [2, 0, 1]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_that_fails_fast_never_leaves_a_hedged_call_on_a_silent_one() {
        use Acts::*;
        // The balanced try and the first hedge are on silent members, the
        // second hedge fails at once: the third member, not tried yet, is.
        let (answer, took) = hedged(Silent, &[Silent, FailsFast, Answers]).await;
        assert_eq!(answer, Ok(2));
        assert!(took < HEDGE_AFTER * 2, "{took:?}");
        // The same with the failing member first.
        let (answer, _) = hedged(Silent, &[FailsFast, Silent, Answers]).await;
        assert_eq!(answer, Ok(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_balanced_try_that_fails_fast_is_hedged_at_once() {
        use Acts::*;
        let (answer, took) = hedged(FailsFast, &[Answers, Answers, Answers]).await;
        assert_eq!(answer, Ok(0));
        assert!(took < HEDGE_AFTER, "{took:?}");
        // A shard of one endpoint has no member to hedge to: its failure is
        // the answer, at once.
        let (answer, took) = hedged(FailsFast, &[]).await;
        assert!(answer.unwrap_err().contains("broken pipe"));
        assert_eq!(took, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_any_member_would_give_ends_a_hedged_call() {
        use Acts::*;
        // Not waited past, and not hidden by a later failure elsewhere.
        let (answer, took) = hedged(LeaseGone, &[Answers]).await;
        assert!(answer.unwrap_err().contains("lease not found"));
        assert_eq!(took, Duration::ZERO);
        let (answer, _) = hedged(Silent, &[LeaseGone, FailsFast]).await;
        assert!(answer.unwrap_err().contains("lease not found"));
        // An overloaded leader is not sent more of the same.
        let (answer, took) = hedged(TooMany, &[Answers, Answers]).await;
        assert!(answer.unwrap_err().contains("too many requests"));
        assert_eq!(took, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hedged_call_fails_with_the_last_failure_once_every_member_failed() {
        use Acts::*;
        let (answer, took) = hedged(FailsFast, &[FailsFast, FailsFast, FailsFast]).await;
        assert!(answer.unwrap_err().contains("member 2"));
        assert_eq!(took, Duration::ZERO);
        // The balanced try answers before the hedges are sent: none is.
        let (answer, took) = hedged(Answers, &[Silent]).await;
        assert_eq!(answer, Ok(usize::MAX));
        assert_eq!(took, Duration::from_millis(5));
    }

    #[test]
    fn the_leader_is_the_serving_member_whose_id_it_is() {
        let ids = [Some(11), Some(12), Some(13)];
        let healthy = [Some((12, 5)); 3];
        assert_eq!(leader_of(&ids, &healthy, &serving(&healthy)), Some(1));
        // The leader does not answer: the others name it, but no member
        // that answered is it.
        let silent = [Some((12, 5)), None, Some((12, 5))];
        let no_id = [Some(11), None, Some(13)];
        assert_eq!(leader_of(&no_id, &silent, &serving(&silent)), None);
        // A minority leader of an older term is not the leader.
        let split = [Some((11, 5)), Some((12, 6)), Some((12, 6))];
        assert_eq!(leader_of(&ids, &split, &serving(&split)), Some(1));
        let deposed = [Some((11, 5)), Some((13, 6)), Some((13, 6))];
        assert_eq!(leader_of(&ids, &deposed, &serving(&deposed)), Some(2));
        // An election: nobody leads.
        let election = [Some((0, 7)); 3];
        assert_eq!(leader_of(&ids, &election, &serving(&election)), None);
    }

    #[test]
    fn members_cut_off_from_their_peers_do_not_serve() {
        // A healthy shard: leader 1 at term 5, seen by all.
        assert_eq!(serving(&[Some((1, 5)); 3]), [true; 3]);
        // A minority leader (member 1, term 5) while the majority elected
        // member 2 at term 6; one member does not answer.
        assert_eq!(
            serving(&[Some((1, 5)), Some((2, 6)), None]),
            [false, true, false]
        );
        // A member campaigning alone: no leader, and a term above the
        // majority's. It must not make the majority look stale.
        assert_eq!(
            serving(&[Some((0, 9)), Some((2, 6)), Some((2, 6))]),
            [false, true, true]
        );
        // An election everywhere: nobody serves (the caller then leaves
        // the rotation alone).
        assert_eq!(serving(&[Some((0, 7)), Some((0, 7)), None]), [false; 3]);
    }

    #[test]
    fn releases_with_known_lease_bugs_are_named() {
        assert_eq!(release_risk("3.4.23"), Some(Risk::StaleLeaderRevokes));
        assert_eq!(release_risk("3.4.31"), None);
        assert_eq!(release_risk("3.5.1"), Some(Risk::Unsafe));
        assert_eq!(release_risk("3.5.12"), Some(Risk::StaleLeaderRevokes));
        assert_eq!(release_risk("3.5.13"), None);
        assert_eq!(release_risk("3.6.0-rc.1"), None);
        assert_eq!(release_risk("3.3.25"), Some(Risk::StaleLeaderRevokes));
        assert_eq!(release_risk("garbage"), None);
    }
}

/// gRPC status codes (numbers fixed by the gRPC spec) that mean "try again".
mod tonic_code {
    /// etcd's "too many requests".
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const UNAVAILABLE_CODES: [i32; 5] = [
        1,  // Cancelled
        2,  // Unknown: transport errors surface as Unknown in tonic
        4,  // DeadlineExceeded
        8,  // ResourceExhausted
        14, // Unavailable (no leader, member stopping, connection refused)
    ];
}
