//! Coalesced lease keepalives: a few shared gRPC streams per shard for
//! leases known to be alive, and isolated probes for the rest.
//!
//! etcd-client's `lease_keep_alive(id)` opens a stream per lease, but etcd's
//! KeepAlive stream accepts any lease id, so a task per *main* stream (one
//! per shard unless `etcd.keepalive_streams` asks for more, each lease
//! always on the same one) multiplexes many leases over it. Renewals of one
//! lease are coalesced: while a keepalive for it is in flight, or one was
//! confirmed less than the caller's window ago, no new keepalive is sent.
//!
//! Why two lanes: etcd answers a keepalive of an expired lease that is not
//! revoked yet only once the revoke is applied, and a stream answers in
//! order, so one such keepalive stalls every renewal behind it (seconds,
//! when thousands of leases expire at once). The main stream therefore only
//! carries leases this router saw alive with time to spare. A lease it knows
//! nothing recent of (granted through another replica, or close to its end)
//! is *probed* on a stream of its own, at most [`MAX_PROBES`] at a time, each
//! bounded by the shard's deadline; a lease etcd said is gone is answered
//! from memory and never sent again.
//!
//! The task's loop never waits on the network: streams are opened and
//! written by tasks of their own, which report back as events, and the main
//! stream's answers are one more source the loop selects on (an answer
//! wakes the task once, with no hand-off from a reader task). What the
//! task learnt ([`Known`]) is shared with callers, so a renewal that a
//! recent answer already covers (or of a lease known gone) is answered in
//! the caller's own task, with no message to the keepalive task.
//!
//! Honest expiry: a [`Renewal`] counts the lease's time from the instant the
//! keepalive (or grant) was *sent*, never from when etcd answered, so the
//! deadline it reports is never later than etcd's own. Every answer is
//! tagged with the generation of the stream it came on, and counts only
//! against a send on that same stream: after a fail-over, a late answer of
//! the old stream never completes the re-send.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::shard::conn::{EtcdConn, EtcdError};

/// Lease probes in flight at once per shard.
pub const MAX_PROBES: usize = 64;
/// A lease goes on the main stream only with at least this much of its
/// known life left, so its keepalive reaches etcd before it expires.
const MAIN_MARGIN: Duration = Duration::from_millis(500);
/// Keepalives queued for the main stream's writer before callers are told
/// the shard is overloaded.
const WRITER_QUEUE: usize = 8_192;
/// The main stream counts as silent when a keepalive on it has waited
/// this long and no answer at all came on it meanwhile: it is reopened on
/// another member (a stream answers every keepalive in order, so a stream
/// that is merely busy keeps answering).
const SILENT_STREAM: Duration = Duration::from_millis(150);
/// Most keepalives in one burst: etcd-client's stream takes 100 before it
/// makes a sender wait.
const MAX_BURST: usize = 100;
/// How long a stream is not moved back to the leader it failed on.
const SHUN_FOR: Duration = Duration::from_secs(5);
/// How often in-flight keepalives are looked at once the first of them
/// has waited [`SILENT_STREAM`].
const TICK: Duration = Duration::from_millis(25);
/// How often the task looks at its stream with nothing in flight (is it
/// on the leader?), and forgets expired renewals and old dead leases (a
/// sweep of every lease the shard knows: not on every look).
const PRUNE_EVERY: Duration = Duration::from_secs(1);
/// How long a lease etcd reported gone is remembered.
const DEAD_FOR: Duration = Duration::from_secs(600);
/// Most dead leases remembered.
const MAX_DEAD: usize = 100_000;

/// What the router knows of a lease after renewing it.
#[derive(Debug, Clone, Copy)]
pub struct Renewal {
    /// When the keepalive or grant that produced this was sent.
    pub sent_at: Instant,
    /// TTL etcd reported, in seconds; 0 means the lease is gone.
    pub ttl_secs: i64,
}

impl Renewal {
    pub fn alive(&self) -> bool {
        self.ttl_secs > 0
    }

    /// Conservative expiry: `sent_at + ttl`.
    pub fn deadline(&self) -> Instant {
        self.sent_at + Duration::from_secs(self.ttl_secs.max(0) as u64)
    }

    fn gone(sent_at: Instant) -> Self {
        Self {
            sent_at,
            ttl_secs: 0,
        }
    }
}

type Reply = oneshot::Sender<Result<Renewal, EtcdError>>;

enum Msg {
    Refresh {
        lease: i64,
        window: Duration,
        /// The lease's TTL as the caller knows it (never above etcd's), for
        /// a probe, whose answer etcd-client does not pass on.
        ttl_secs: u32,
        /// Sent at once rather than with the next burst.
        urgent: bool,
        reply: Reply,
    },
}

enum Event {
    /// An answer on the main stream of this generation.
    Response { generation: u64, id: i64, ttl: i64 },
    /// The main stream of this generation ended or failed.
    Ended { generation: u64, detail: String },
    /// The main stream of this generation was opened (or not).
    Opened {
        generation: u64,
        opener: i64,
        result: Result<(LeaseKeeper, LeaseKeepAliveStream), EtcdError>,
    },
    /// A probe finished.
    Probed {
        lease: i64,
        result: Result<Renewal, EtcdError>,
    },
}

/// What the router learnt of leases from etcd: the last confirmed renewal
/// of each live lease, and the leases etcd said are gone. Written by the
/// keepalive task, read by callers too. std `Mutex`: never held across an
/// await, every access a map operation.
#[derive(Default)]
struct Known {
    inner: Mutex<KnownLeases>,
}

#[derive(Default)]
struct KnownLeases {
    /// Last confirmed renewal per live lease (pruned once expired).
    recent: HashMap<i64, Renewal>,
    /// Leases etcd reported gone, and when.
    dead: HashMap<i64, Instant>,
}

impl Known {
    fn lock(&self) -> std::sync::MutexGuard<'_, KnownLeases> {
        self.inner.lock().expect("known leases lock")
    }

    /// The answer to a renewal of `lease` that needs no keepalive: gone, or
    /// confirmed less than `window` ago.
    fn answer(&self, lease: i64, window: Duration, now: Instant) -> Option<Renewal> {
        let known = self.lock();
        if known.dead.contains_key(&lease) {
            return Some(Renewal::gone(now));
        }
        known
            .recent
            .get(&lease)
            .filter(|r| now.saturating_duration_since(r.sent_at) < window)
            .copied()
    }

    /// Whether the last confirmed renewal of `lease` keeps it alive past
    /// `until` (etcd expires a lease no earlier than that renewal's
    /// [`Renewal::deadline`]).
    fn lasts(&self, lease: i64, until: Instant) -> bool {
        let known = self.lock();
        !known.dead.contains_key(&lease)
            && known
                .recent
                .get(&lease)
                .is_some_and(|r| r.deadline() > until)
    }

    /// The last confirmed renewal of `lease`, if it is not known gone.
    fn recent(&self, lease: i64) -> Option<Renewal> {
        self.lock().recent.get(&lease).copied()
    }

    /// Records what etcd said of `lease`.
    fn learn(&self, lease: i64, renewal: Renewal) {
        let mut known = self.lock();
        if renewal.alive() {
            known.dead.remove(&lease);
            known.recent.insert(lease, renewal);
        } else {
            known.recent.remove(&lease);
            if known.dead.len() >= MAX_DEAD {
                known.dead.clear();
            }
            known.dead.insert(lease, Instant::now());
        }
    }

    /// Forgets renewals that have run out and dead leases past `DEAD_FOR`.
    fn prune(&self, now: Instant) {
        let mut known = self.lock();
        known.recent.retain(|_, r| r.deadline() > now);
        known
            .dead
            .retain(|_, at| now.saturating_duration_since(*at) < DEAD_FOR);
    }
}

/// How a shard's keepalives go out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepaliveSettings {
    /// How long a main stream's writer gathers keepalives after the first
    /// of a burst (0: each is sent as it comes).
    pub burst: Duration,
    /// Main streams per shard (`etcd.keepalive_streams`), each with a task
    /// of its own; a lease always goes on the same one.
    pub streams: usize,
}

/// Handle to the shard's keepalive tasks, one per main stream; dropping it
/// stops them.
///
/// Why several streams: etcd answers one stream's keepalives one after the
/// other, and etcd 3.4.31 and 3.5.13 on first may make each wait for a
/// check that its member still leads (a ReadIndex round to a quorum;
/// 3.5.16 skips it while its raft ticks are recent), so one stream's rate
/// is bounded by that loop (docs/capacity.md, "Keepalive streams"). Each
/// lease is kept on one stream, chosen by its id ([`lane_of`]), so what a
/// stream's task learns of a lease is all there is to learn, and the
/// streams share nothing.
pub struct Keepalive {
    lanes: Vec<Lane>,
}

/// The index of the stream that carries `lease`, of `lanes`. etcd numbers
/// the leases a member grants in sequence, so the id is spread by
/// Fibonacci hashing (its top 32 bits after a multiply by 2^64 / φ), and
/// that fraction of the circle is scaled to `lanes` rather than taken
/// modulo: consecutive ids then land on the streams evenly even a few at a
/// time (a modulo put runs of four on one stream, leaving a stream idle
/// for a client's handful of sessions).
fn lane_of(lease: i64, lanes: usize) -> usize {
    let mixed = (lease as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    ((mixed * lanes as u64) >> 32) as usize
}

impl Keepalive {
    pub fn start(conn: EtcdConn, settings: KeepaliveSettings, cancel: CancellationToken) -> Self {
        let lanes = (0..settings.streams.max(1))
            .map(|lane| Lane::start(conn.clone(), lane, settings.burst, cancel.child_token()))
            .collect();
        Self { lanes }
    }

    fn lane(&self, lease: i64) -> &Lane {
        &self.lanes[lane_of(lease, self.lanes.len())]
    }

    /// Renews `lease` unless a keepalive for it is in flight or was sent less
    /// than `window` ago; answers with what the router then knows, within
    /// the shard's keepalive deadline. A keepalive it sends goes out at once
    /// (with any burst waiting): for acquires, whose clients wait on it.
    pub async fn refresh(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        self.lane(lease).ask(lease, window, ttl_secs, true).await
    }

    /// [`Keepalive::refresh`] for renewals: a keepalive it sends may wait
    /// for the next burst (`etcd.keepalive_burst_ms`), as renewals come
    /// every third of a TTL and do not notice.
    pub async fn refresh_in_burst(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        self.lane(lease).ask(lease, window, ttl_secs, false).await
    }

    /// Whether `lease` is known to stay alive for at least `margin` more,
    /// by its last confirmed renewal, with no keepalive sent.
    pub fn lasts(&self, lease: i64, margin: Duration) -> bool {
        self.lane(lease).known.lasts(lease, Instant::now() + margin)
    }

    /// The last renewal of `lease` etcd confirmed (a keepalive's answer or
    /// its grant), unless it is known gone since or its deadline passed:
    /// the lease lasts at least until that deadline.
    pub fn confirmed(&self, lease: i64) -> Option<Renewal> {
        let known = self.lane(lease).known.recent(lease);
        known.filter(|r| r.deadline() > Instant::now())
    }

    /// A lease was just granted: its grant counts as a keepalive.
    pub fn seed(&self, lease: i64, renewal: Renewal) {
        self.lane(lease).known.learn(lease, renewal);
    }
}

/// One main stream's task, and what it learnt.
struct Lane {
    tx: mpsc::Sender<Msg>,
    known: Arc<Known>,
    /// Longest a caller waits for an answer (a fail-over may send twice).
    deadline: Duration,
    conn: EtcdConn,
    _task: crate::task::TaskGuard,
}

impl Lane {
    fn start(conn: EtcdConn, lane: usize, burst: Duration, cancel: CancellationToken) -> Self {
        let (tx, rx) = mpsc::channel(4096);
        let deadline = conn.timeout() * 2;
        let known = Arc::new(Known::default());
        let task = Task::new(conn.clone(), lane, known.clone(), burst);
        let task = tokio::spawn(task.run(rx, cancel.clone()));
        Self {
            tx,
            known,
            deadline,
            conn,
            _task: crate::task::TaskGuard::new(task, cancel),
        }
    }

    async fn ask(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
        urgent: bool,
    ) -> Result<Renewal, EtcdError> {
        if let Some(answer) = self.known.answer(lease, window, Instant::now()) {
            self.conn.metrics().lease_renewals(1);
            return Ok(answer);
        }
        let ask = async {
            let (reply, rx) = oneshot::channel();
            let msg = Msg::Refresh {
                lease,
                window,
                ttl_secs,
                urgent,
                reply,
            };
            self.tx.send(msg).await.map_err(|_| self.stopped())?;
            rx.await.map_err(|_| self.stopped())?
        };
        match tokio::time::timeout(self.deadline, ask).await {
            Ok(answer) => answer,
            Err(_) => Err(EtcdError::Unavailable {
                shard: self.conn.shard().to_string(),
                detail: "no keepalive answer in time".into(),
            }),
        }
    }

    fn stopped(&self) -> EtcdError {
        EtcdError::Other {
            shard: self.conn.shard().to_string(),
            detail: "keepalive task stopped".into(),
        }
    }
}

/// A keepalive on the main stream awaiting its answer.
struct Inflight {
    sent_at: Instant,
    /// The stream it was sent on; only that stream's answer counts.
    generation: u64,
    waiters: Vec<Reply>,
    /// Already re-sent once after a broken stream.
    retried: bool,
}

/// The main stream, by state.
enum Main {
    Closed,
    /// Being opened by a task of its own; keepalives wait in `queued`.
    Opening {
        generation: u64,
    },
    Open {
        generation: u64,
        /// Leases to keep alive, and whether each goes at once.
        writer: mpsc::Sender<(i64, bool)>,
        /// The writer; the stream's answers are read by the task's own loop.
        writer_task: JoinHandle<()>,
    },
}

/// A lease waiting for the main stream to open.
struct Queued {
    waiters: Vec<Reply>,
    retried: bool,
}

struct Task {
    conn: EtcdConn,
    /// Which of the shard's main streams this task keeps (for metrics).
    lane: usize,
    main: Main,
    generation: u64,
    /// The member the main stream was opened on (shards with several).
    main_member: Option<usize>,
    /// The member a stream last failed on, and when: not moved back to
    /// for [`SHUN_FOR`] even if it leads.
    failed_on: Option<(usize, Instant)>,
    /// The last answer on the main stream, or when it opened.
    last_answer: Instant,
    inflight: HashMap<i64, Inflight>,
    queued: HashMap<i64, Queued>,
    probes: HashMap<i64, Vec<Reply>>,
    probe_slots: Arc<Semaphore>,
    known: Arc<Known>,
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    /// How long the main stream's writer gathers a burst.
    burst: Duration,
    /// When [`Known`] was last pruned.
    pruned: Instant,
    /// When the task last looked at its stream ([`Task::look`]).
    looked: Instant,
    /// Since when keepalives have been in flight without a break.
    busy_since: Option<Instant>,
    /// The main stream just opened, for the loop to read from.
    fresh: Option<(u64, LeaseKeepAliveStream)>,
}

impl Task {
    fn new(conn: EtcdConn, lane: usize, known: Arc<Known>, burst: Duration) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        Self {
            conn,
            lane,
            main: Main::Closed,
            generation: 0,
            main_member: None,
            failed_on: None,
            last_answer: Instant::now(),
            inflight: HashMap::new(),
            queued: HashMap::new(),
            probes: HashMap::new(),
            probe_slots: Arc::new(Semaphore::new(MAX_PROBES)),
            pruned: Instant::now(),
            looked: Instant::now(),
            busy_since: None,
            fresh: None,
            known,
            events_tx,
            events_rx,
            burst,
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Msg>, cancel: CancellationToken) {
        // No ticking while nothing is in flight: a shard's idle task wakes
        // once a second, not forty times.
        let mut armed = self.next_look();
        let look = tokio::time::sleep_until(armed.into());
        tokio::pin!(look);
        // The main stream's answers, read here rather than by a task of
        // their own: one wake-up per answer instead of two.
        let mut stream: Option<(u64, LeaseKeepAliveStream)> = None;
        loop {
            if let Some(fresh) = self.fresh.take() {
                stream = Some(fresh);
            }
            if stream
                .as_ref()
                .is_some_and(|(g, _)| Some(*g) != self.main_generation())
            {
                stream = None; // failed over or closed
            }
            let due = self.next_look();
            if due != armed {
                armed = due;
                look.as_mut().reset(due.into());
            }
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(Msg::Refresh { lease, window, ttl_secs, urgent, reply }) => {
                        self.refresh(lease, window, ttl_secs, urgent, reply)
                    }
                    None => break,
                },
                Some(ev) = self.events_rx.recv() => self.on_event(ev),
                (generation, answer) = answer(&mut stream) => self.on_event(match answer {
                    Ok(Some(resp)) => Event::Response { generation, id: resp.id(), ttl: resp.ttl() },
                    Ok(None) => Event::Ended { generation, detail: "stream closed by etcd".into() },
                    Err(e) => Event::Ended { generation, detail: e.to_string() },
                }),
                _ = &mut look => self.look(),
                _ = cancel.cancelled() => break,
            }
        }
        self.close("shutting down");
    }

    fn refresh(&mut self, lease: i64, window: Duration, ttl_secs: u32, urgent: bool, reply: Reply) {
        self.conn.metrics().lease_renewals(1);
        let now = Instant::now();
        // Checked again: an answer may have come since the caller looked.
        if let Some(answer) = self.known.answer(lease, window, now) {
            let _ = reply.send(Ok(answer));
            return;
        }
        let known = self.known.recent(lease);
        if let Some(inflight) = self.inflight.get_mut(&lease) {
            inflight.waiters.push(reply);
            return;
        }
        if let Some(q) = self.queued.get_mut(&lease) {
            q.waiters.push(reply);
            return;
        }
        if let Some(waiters) = self.probes.get_mut(&lease) {
            waiters.push(reply);
            return;
        }
        let alive_for = known.map_or(Duration::ZERO, |r| {
            r.deadline().saturating_duration_since(now)
        });
        if alive_for >= MAIN_MARGIN {
            self.send_main(lease, vec![reply], false, urgent);
        } else {
            self.probe(lease, ttl_secs, reply);
        }
    }

    /// Sends one keepalive of `lease` on the main stream, opening it first
    /// if needed.
    fn send_main(&mut self, lease: i64, waiters: Vec<Reply>, retried: bool, urgent: bool) {
        match &self.main {
            Main::Open {
                generation, writer, ..
            } => match writer.try_send((lease, urgent)) {
                Ok(()) => {
                    self.conn.metrics().keepalive_sent();
                    let inflight = Inflight {
                        sent_at: Instant::now(),
                        generation: *generation,
                        waiters,
                        retried,
                    };
                    self.inflight.insert(lease, inflight);
                }
                Err(_) => self.fail(waiters, "too many keepalives queued for the shard"),
            },
            Main::Opening { .. } => {
                self.queued.insert(lease, Queued { waiters, retried });
            }
            Main::Closed => {
                self.queued.insert(lease, Queued { waiters, retried });
                self.open(lease);
            }
        }
    }

    /// Opens the main stream in a task of its own. etcd-client's opener
    /// sends a first keepalive for `opener` and consumes its answer; the
    /// queued keepalives (`opener`'s included) are sent once it is open, so
    /// every answer reaches its waiters through the reader.
    fn open(&mut self, opener: i64) {
        self.generation += 1;
        let generation = self.generation;
        self.main = Main::Opening { generation };
        // On the leader (a follower forwards each keepalive to it, one at a
        // time), else on a member in turn; never the one a silent stream
        // was on while another is in rotation.
        let now = Instant::now();
        let avoid = match self.failed_on {
            Some((m, at)) if now.saturating_duration_since(at) < SHUN_FOR => Some(m),
            _ => self.main_member,
        };
        let member = self.conn.keepalive_member(avoid);
        self.main_member = member.as_ref().map(|(i, _)| *i);
        tracing::debug!(shard = %self.conn.shard(), lane = self.lane, generation, member = ?self.main_member, ?avoid, "opening a keepalive stream");
        let client = member.map_or_else(|| self.conn.client().clone(), |(_, c)| c);
        let (conn, events) = (self.conn.clone(), self.events_tx.clone());
        tokio::spawn(async move {
            let mut client = client.lease_client();
            let result = conn.call("LeaseKeepAlive", client.keep_alive(opener)).await;
            let _ = events.send(Event::Opened {
                generation,
                opener,
                result,
            });
        });
    }

    /// Renews `lease` on a stream of its own, so that a lease etcd holds up
    /// stalls nobody else.
    fn probe(&mut self, lease: i64, ttl_secs: u32, reply: Reply) {
        self.probes.insert(lease, vec![reply]);
        let (conn, events) = (self.conn.clone(), self.events_tx.clone());
        let slots = self.probe_slots.clone();
        tokio::spawn(async move {
            let result = match tokio::time::timeout(conn.timeout(), slots.acquire_owned()).await {
                Ok(Ok(_permit)) => {
                    let sent_at = Instant::now();
                    conn.metrics().keepalive_sent();
                    // Hedged (a keepalive may be sent twice); the first
                    // send's instant counts, as it is the earliest.
                    let renew = |client: etcd_client::Client| async move {
                        client.lease_client().keep_alive(lease).await
                    };
                    match conn.call_hedged("LeaseKeepAlive", renew).await {
                        // Dropping the keeper and stream closes the probe's stream.
                        Ok(_) => Ok(Renewal {
                            sent_at,
                            ttl_secs: ttl_secs.into(),
                        }),
                        Err(EtcdError::LeaseNotFound) => Ok(Renewal::gone(sent_at)),
                        Err(e) => Err(e),
                    }
                }
                _ => Err(conn.unavailable("too many lease checks in flight")),
            };
            let _ = events.send(Event::Probed { lease, result });
        });
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Response {
                generation,
                id,
                ttl,
            } => {
                let ours = self
                    .inflight
                    .get(&id)
                    .is_some_and(|i| i.generation == generation);
                if !ours {
                    return; // an answer to a send on an older stream
                }
                self.last_answer = Instant::now();
                let inflight = self.inflight.remove(&id).expect("checked above");
                let renewal = Renewal {
                    sent_at: inflight.sent_at,
                    ttl_secs: ttl,
                };
                self.learn(id, renewal);
                for w in inflight.waiters {
                    let _ = w.send(Ok(renewal));
                }
                if self.inflight.is_empty() {
                    self.move_to_leader(Instant::now());
                }
            }
            Event::Ended { generation, detail } => {
                if self.main_generation() == Some(generation) {
                    self.fail_over("ended", &detail);
                }
            }
            Event::Opened {
                generation,
                opener,
                result,
            } => self.opened(generation, opener, result),
            Event::Probed { lease, result } => {
                let waiters = self.probes.remove(&lease).unwrap_or_default();
                if let Ok(renewal) = result {
                    self.learn(lease, renewal);
                }
                for w in waiters {
                    let _ = w.send(result.clone());
                }
            }
        }
    }

    fn opened(
        &mut self,
        generation: u64,
        opener: i64,
        result: Result<(LeaseKeeper, LeaseKeepAliveStream), EtcdError>,
    ) {
        if !matches!(self.main, Main::Opening { generation: g } if g == generation) {
            return;
        }
        match result {
            Ok((keeper, stream)) => {
                let (writer, rx) = mpsc::channel(WRITER_QUEUE);
                let writer_task = tokio::spawn(write(
                    keeper,
                    rx,
                    generation,
                    self.events_tx.clone(),
                    (self.conn.shard().to_string(), self.lane),
                    self.burst,
                ));
                self.fresh = Some((generation, stream));
                self.main = Main::Open {
                    generation,
                    writer,
                    writer_task,
                };
                self.last_answer = Instant::now();
                self.conn.metrics().keepalive_sent();
                for (lease, q) in std::mem::take(&mut self.queued) {
                    self.send_main(lease, q.waiters, q.retried, true);
                }
            }
            Err(EtcdError::LeaseNotFound) => {
                // The opener's lease is gone; open again for the others.
                self.main = Main::Closed;
                if let Some(q) = self.queued.remove(&opener) {
                    self.learn(opener, Renewal::gone(Instant::now()));
                    for w in q.waiters {
                        let _ = w.send(Ok(Renewal::gone(Instant::now())));
                    }
                }
                if let Some(&next) = self.queued.keys().next() {
                    self.open(next);
                }
            }
            Err(e) => {
                self.main = Main::Closed;
                let detail = e.to_string();
                tracing::warn!(shard = %self.conn.shard(), lane = self.lane, member = ?self.main_member, error = %detail, waiting = self.queued.len(), "a keepalive stream did not open; the keepalives waiting for it fail");
                for (_, q) in std::mem::take(&mut self.queued) {
                    self.fail(q.waiters, &detail);
                }
            }
        }
    }

    /// Records what etcd said of `lease`.
    fn learn(&mut self, lease: i64, renewal: Renewal) {
        self.known.learn(lease, renewal);
    }

    fn main_generation(&self) -> Option<u64> {
        match &self.main {
            Main::Open { generation, .. } => Some(*generation),
            _ => None,
        }
    }

    /// When the task should next [`look`](Task::look): a second after the
    /// last look while nothing is in flight; [`SILENT_STREAM`] (or the
    /// shard's deadline, if shorter) after keepalives went in flight, then
    /// every [`TICK`] while any still is
    /// (so a silent stream is found, as before, within `SILENT_STREAM +
    /// TICK` of its first unanswered keepalive).
    fn next_look(&mut self) -> Instant {
        if self.inflight.is_empty() {
            self.busy_since = None;
            return self.looked + PRUNE_EVERY;
        }
        let since = *self.busy_since.get_or_insert_with(Instant::now);
        // Sooner when a keepalive is overdue before it could be silent.
        let first = SILENT_STREAM.min(self.conn.timeout());
        (since + first).max(self.looked + TICK)
    }

    /// Looks at the stream: prunes what the task knows once a second, fails
    /// the stream over when its keepalives are overdue or it went silent,
    /// and moves it to the leader once nothing is in flight on it.
    fn look(&mut self) {
        let now = Instant::now();
        self.looked = now;
        if now.saturating_duration_since(self.pruned) >= PRUNE_EVERY {
            self.known.prune(now);
            self.pruned = now;
        }
        let timeout = self.conn.timeout();
        let waited = |i: &Inflight| now.saturating_duration_since(i.sent_at);
        if self.inflight.values().any(|i| waited(i) > timeout) {
            self.fail_over("overdue", "keepalive answers overdue");
            return;
        }
        let Some(current) = self.main_generation() else {
            return;
        };
        if self.inflight.is_empty() {
            self.move_to_leader(now);
            return;
        }
        let silent = now.saturating_duration_since(self.last_answer) > SILENT_STREAM
            && self
                .inflight
                .values()
                .any(|i| i.generation == current && waited(i) > SILENT_STREAM);
        if silent {
            self.conn.metrics().keepalive_stream_silent();
            self.fail_over("silent", "keepalive stream silent");
        }
    }

    /// The stream is on a member that no longer leads (or never did: no
    /// leader was known when it opened): closed once nothing is in flight
    /// on it (looked at then, and once a second), and the next keepalive
    /// opens one on the leader.
    fn move_to_leader(&mut self, now: Instant) {
        let leader = self.conn.leader().filter(|&l| {
            // Not back to a member a stream just failed on, which may
            // still be in rotation until the next probes.
            !matches!(self.failed_on, Some((m, at)) if m == l && now.saturating_duration_since(at) < SHUN_FOR)
        });
        let elsewhere =
            leader.is_some() && self.main_member.is_some() && leader != self.main_member;
        if elsewhere && self.inflight.is_empty() && self.main_generation().is_some() {
            tracing::debug!(shard = %self.conn.shard(), from = ?self.main_member, to = ?leader, "keepalive stream moves to the leader");
            self.stop_main();
        }
    }

    /// The main stream broke (a member died, a connection reset) or went
    /// silent: send what was in flight once more on a fresh stream, which
    /// the client opens to a live member. Only keepalives that fail twice
    /// are reported unavailable. The re-send's instant counts for the
    /// deadline, and only the new stream's answer completes it.
    fn fail_over(&mut self, reason: &'static str, detail: &str) {
        self.conn.metrics().keepalive_stream_failover(reason);
        let retried = self.inflight.values().filter(|i| i.retried).count();
        tracing::info!(
            shard = %self.conn.shard(),
            lane = self.lane,
            member = ?self.main_member,
            reason,
            %detail,
            in_flight = self.inflight.len(),
            failing = retried,
            "keepalive stream failed over; re-sending its keepalives on a fresh stream"
        );
        if let Some(member) = self.main_member {
            self.failed_on = Some((member, Instant::now()));
        }
        self.stop_main();
        let pending: Vec<(i64, Inflight)> = self.inflight.drain().collect();
        for (lease, inflight) in pending {
            if inflight.retried {
                self.fail(inflight.waiters, detail);
            } else {
                self.send_main(lease, inflight.waiters, true, true);
            }
        }
    }

    fn stop_main(&mut self) {
        if let Main::Open { writer_task, .. } = std::mem::replace(&mut self.main, Main::Closed) {
            writer_task.abort();
        }
        self.fresh = None;
    }

    fn fail(&self, waiters: Vec<Reply>, detail: &str) {
        for w in waiters {
            let _ = w.send(Err(self
                .conn
                .unavailable(format!("keepalive stream: {detail}"))));
        }
    }

    /// Drops the stream and fails everything waiting on it.
    fn close(&mut self, detail: &str) {
        self.stop_main();
        let inflight: Vec<Vec<Reply>> = self.inflight.drain().map(|(_, i)| i.waiters).collect();
        let queued: Vec<Vec<Reply>> = self.queued.drain().map(|(_, q)| q.waiters).collect();
        for waiters in inflight.into_iter().chain(queued) {
            self.fail(waiters, detail);
        }
    }
}

/// Writes the main stream's keepalives in bursts, so a full gRPC send
/// buffer holds up this task, never the keepalive task's loop.
///
/// etcd pays per message it reads, not per keepalive: one keepalive per
/// HTTP/2 frame cost a 3.4 server about 340 µs of CPU each, twenty per frame
/// 88 µs. So bursts are spaced `window` apart (`etcd.keepalive_burst_ms`,
/// 20 ms by default), as the lock-key cache's barriers are
/// (`etcd.barrier_spacing_ms`): a keepalive
/// that finds no burst sent within `window` goes at once, so a trickle
/// waits for nothing; under load the writer gathers every keepalive that
/// comes until `window` after the last burst (or [`MAX_BURST`] of them)
/// and hands them to the stream back to back, without yielding in between: the stream's
/// encoder, woken by the first, runs only after the last and puts them all
/// in one frame. The expiry each reports still counts from when it was
/// queued here (`Inflight::sent_at`), earlier than the wire: honest.
async fn write(
    mut keeper: LeaseKeeper,
    mut rx: mpsc::Receiver<(i64, bool)>,
    generation: u64,
    events: mpsc::UnboundedSender<Event>,
    (shard, lane): (String, usize),
    window: Duration,
) {
    let mut burst = Vec::with_capacity(MAX_BURST);
    let mut last_burst: Option<tokio::time::Instant> = None;
    while let Some((first, mut urgent)) = rx.recv().await {
        burst.push(first);
        // A keepalive that finds no burst sent within `window` goes at
        // once, and so does one an acquire waits on (with the burst so
        // far); else it waits for the next burst, `window` after the last,
        // with every keepalive that comes meanwhile.
        let next = last_burst.map(|t| t + window);
        if let Some(next) = next.filter(|&n| !urgent && n > tokio::time::Instant::now()) {
            while burst.len() < MAX_BURST && !urgent {
                match tokio::time::timeout_at(next, rx.recv()).await {
                    Ok(Some((lease, now))) => {
                        burst.push(lease);
                        urgent = now;
                    }
                    Ok(None) | Err(_) => break,
                }
            }
        }
        while burst.len() < MAX_BURST && !window.is_zero() {
            match rx.try_recv() {
                Ok((lease, _)) => burst.push(lease),
                Err(_) => break,
            }
        }
        last_burst = Some(tokio::time::Instant::now());
        m::keepalive_burst(&shard, lane, burst.len());
        for lease in burst.drain(..) {
            keeper.id = lease;
            if let Err(e) = keeper.keep_alive().await {
                let detail = format!("keepalive send failed: {e}");
                let _ = events.send(Event::Ended { generation, detail });
                return;
            }
        }
    }
}

/// The next answer on the main stream, with the stream's generation; never
/// ready while there is no stream.
async fn answer(
    stream: &mut Option<(u64, LeaseKeepAliveStream)>,
) -> (
    u64,
    Result<Option<etcd_client::LeaseKeepAliveResponse>, etcd_client::Error>,
) {
    match stream {
        Some((generation, s)) => (*generation, s.message().await),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task over a connection that is never used (port 9 on loopback:
    /// nothing here is sent).
    async fn task() -> Task {
        let endpoints = ["http://127.0.0.1:9".to_string()];
        let second = Duration::from_secs(1);
        let access = crate::shard::access::Access::plain(&endpoints);
        let conn = EtcdConn::connect("t", &access, second, second)
            .await
            .expect("connecting is lazy");
        Task::new(conn, 0, Arc::default(), Duration::from_millis(2))
    }

    /// A task over three members that are never reached (port 9), with
    /// its main stream "open" on member `on`, nothing sent on it yet.
    async fn open_on_member(on: usize) -> Task {
        let endpoints: Vec<String> = (1..=3).map(|i| format!("http://127.0.0.{i}:9")).collect();
        let second = Duration::from_secs(1);
        let access = crate::shard::access::Access::plain(&endpoints);
        let conn = EtcdConn::connect("t", &access, second, second)
            .await
            .expect("connecting is lazy");
        let mut task = Task::new(conn, 0, Arc::default(), Duration::from_millis(2));
        let (writer, _rx) = mpsc::channel(1);
        task.main = Main::Open {
            generation: 1,
            writer,
            writer_task: tokio::spawn(async {}),
        };
        task.main_member = Some(on);
        task.last_answer = Instant::now();
        task
    }

    fn in_flight(
        task: &mut Task,
        lease: i64,
        sent_at: Instant,
    ) -> oneshot::Receiver<Result<Renewal, EtcdError>> {
        let (reply, rx) = oneshot::channel();
        let inflight = Inflight {
            sent_at,
            generation: 1,
            waiters: vec![reply],
            retried: false,
        };
        task.inflight.insert(lease, inflight);
        rx
    }

    #[tokio::test]
    async fn a_stream_off_the_leader_moves_once_nothing_is_in_flight_on_it() {
        // On the leader: stays.
        let mut task = open_on_member(1).await;
        task.conn.set_leader(Some(1));
        task.look();
        assert_eq!(task.main_generation(), Some(1));
        // On a follower with a keepalive in flight: stays until answered.
        let mut task = open_on_member(0).await;
        task.conn.set_leader(Some(1));
        let _rx = in_flight(&mut task, 7, Instant::now());
        task.look();
        assert_eq!(task.main_generation(), Some(1), "closed under a waiter");
        task.on_event(Event::Response {
            generation: 1,
            id: 7,
            ttl: 30,
        });
        assert_eq!(
            task.main_generation(),
            None,
            "moved as soon as the last answer came"
        );
        // Off the leader with nothing in flight: moved at the next look.
        let mut task = open_on_member(0).await;
        task.conn.set_leader(Some(1));
        task.look();
        assert_eq!(task.main_generation(), None, "moved once idle");
        // No leader known: stays where it is.
        let mut task = open_on_member(0).await;
        task.conn.set_leader(None);
        task.look();
        assert_eq!(task.main_generation(), Some(1));
        // The leader is the member a stream just failed on: not back to it.
        let mut task = open_on_member(0).await;
        task.conn.set_leader(Some(1));
        task.failed_on = Some((1, Instant::now()));
        task.look();
        assert_eq!(task.main_generation(), Some(1));
    }

    /// An idle task looks once a second; keepalives in flight are looked
    /// at from [`SILENT_STREAM`] after they went out, then every [`TICK`]
    /// while any is unanswered.
    #[tokio::test]
    async fn an_idle_task_looks_once_a_second_and_a_busy_one_every_tick() {
        let mut task = open_on_member(0).await;
        task.conn.set_leader(Some(0));
        assert_eq!(task.next_look(), task.looked + PRUNE_EVERY);
        let sent = Instant::now();
        let _rx = in_flight(&mut task, 7, sent);
        let first = task.next_look();
        assert!(
            first >= sent + SILENT_STREAM,
            "not before a keepalive could be silent"
        );
        assert!(first <= Instant::now() + SILENT_STREAM);
        assert_eq!(task.next_look(), first, "the spell's start is kept");
        // The spell has lasted SILENT_STREAM: looked at every tick.
        task.busy_since = Some(Instant::now() - SILENT_STREAM * 2);
        task.look();
        assert_eq!(task.main_generation(), Some(1), "answers still come");
        assert_eq!(task.next_look(), task.looked + TICK);
        task.on_event(Event::Response {
            generation: 1,
            id: 7,
            ttl: 30,
        });
        assert_eq!(task.next_look(), task.looked + PRUNE_EVERY);
        assert_eq!(task.busy_since, None, "the next spell starts afresh");
        // A shard deadline shorter than SILENT_STREAM: the first look
        // comes at the deadline, so an overdue keepalive is not kept waiting.
        let short = Duration::from_millis(50);
        let access = crate::shard::access::Access::plain(&["http://127.0.0.1:9".to_string()]);
        let conn = EtcdConn::connect("t", &access, short, short)
            .await
            .expect("connecting is lazy");
        assert_eq!(conn.timeout(), short);
        let mut task = Task::new(conn, 0, Arc::default(), Duration::from_millis(2));
        let _rx = in_flight(&mut task, 7, Instant::now());
        assert!(task.next_look() <= Instant::now() + short);
    }

    #[tokio::test]
    async fn a_stream_waiting_to_move_is_still_watched_for_silence() {
        let mut task = open_on_member(0).await;
        task.conn.set_leader(Some(1));
        let long_ago = Instant::now() - SILENT_STREAM * 2;
        task.last_answer = long_ago;
        let _rx = in_flight(&mut task, 7, long_ago);
        task.look();
        // Failed over: the stream is closed and its keepalive sent again.
        assert_eq!(task.failed_on.map(|(m, _)| m), Some(0));
        assert!(task.inflight.is_empty());
        assert!(task.queued.get(&7).is_some_and(|q| q.retried));
    }

    #[test]
    fn a_lease_always_takes_one_stream_and_sequential_ids_spread_over_all() {
        // etcd numbers a member's leases in sequence under its own prefix.
        let base = 0x694d_8f2a_0000_0000_i64;
        for lanes in 1..=8 {
            let mut count = vec![0usize; lanes];
            for id in base..base + 8_000 {
                let lane = lane_of(id, lanes);
                assert_eq!(lane, lane_of(id, lanes), "stable");
                count[lane] += 1;
            }
            let (least, most) = (count.iter().min().unwrap(), count.iter().max().unwrap());
            assert!(*least * 100 >= most * 98, "{lanes} streams: {count:?}");
            // A few at a time too: every 2 × lanes + 1 leases in a row
            // (etcd's ids step by 1, or by 2 when other ids come between)
            // reach every stream.
            for step in [1, 2] {
                for start in (base..base + 2_000).step_by(step as usize) {
                    let reached: std::collections::HashSet<usize> = (0..2 * lanes as i64 + 1)
                        .map(|j| lane_of(start + step * j, lanes))
                        .collect();
                    assert_eq!(
                        reached.len(),
                        lanes,
                        "{lanes} streams from {start:#x} by {step}"
                    );
                }
            }
        }
        assert_eq!(lane_of(-1, 3), lane_of(-1, 3));
        assert!(lane_of(-1, 8) < 8 && lane_of(i64::MIN, 8) < 8);
    }

    #[tokio::test]
    async fn an_answer_counts_only_against_a_send_on_its_own_stream() {
        let mut task = task().await;
        let (reply, mut rx) = oneshot::channel();
        let resent_at = Instant::now();
        // Re-sent on stream 2 after stream 1 failed over.
        let inflight = Inflight {
            sent_at: resent_at,
            generation: 2,
            waiters: vec![reply],
            retried: true,
        };
        task.inflight.insert(7, inflight);
        // A late answer of stream 1 (to the first send) arrives first.
        task.on_event(Event::Response {
            generation: 1,
            id: 7,
            ttl: 30,
        });
        assert!(rx.try_recv().is_err(), "the re-send is still unanswered");
        task.on_event(Event::Response {
            generation: 2,
            id: 7,
            ttl: 30,
        });
        let renewal = rx.try_recv().unwrap().unwrap();
        assert_eq!(renewal.sent_at, resent_at);
        assert_eq!(renewal.ttl_secs, 30);
    }

    #[test]
    fn only_a_recent_answer_or_a_known_death_answers_without_a_keepalive() {
        let known = Known::default();
        let now = Instant::now();
        let window = Duration::from_millis(500);
        assert!(known.answer(1, window, now).is_none(), "unknown lease");
        let fresh = Renewal {
            sent_at: now - Duration::from_millis(100),
            ttl_secs: 10,
        };
        known.learn(1, fresh);
        let answer = known.answer(1, window, now).expect("within the window");
        // The answer keeps the instant its keepalive was sent.
        assert_eq!(answer.sent_at, fresh.sent_at);
        assert!(known.answer(1, window, now + window).is_none(), "past it");
        known.learn(1, Renewal::gone(now));
        assert!(!known.answer(1, window, now).unwrap().alive(), "gone");
        // A lease granted again under the same id (never, but) comes back.
        known.learn(1, fresh);
        assert!(known.answer(1, window, now).unwrap().alive());
    }

    #[tokio::test]
    async fn leases_known_dead_or_near_their_end_stay_off_the_main_stream() {
        let mut task = task().await;
        // Gone, as etcd said: answered from memory, nothing sent.
        task.known.learn(1, Renewal::gone(Instant::now()));
        let (reply, mut rx) = oneshot::channel();
        task.refresh(1, Duration::ZERO, 10, true, reply);
        assert!(!rx.try_recv().unwrap().unwrap().alive());
        assert!(task.probes.is_empty() && task.queued.is_empty());
        // Known alive with time to spare: the main stream.
        let fresh = Renewal {
            sent_at: Instant::now(),
            ttl_secs: 10,
        };
        task.known.learn(2, fresh);
        let (reply, _rx) = oneshot::channel();
        task.refresh(2, Duration::ZERO, 10, true, reply);
        assert!(task.queued.contains_key(&2), "queued for the main stream");
        // Close to its end (or unknown): probed on a stream of its own.
        let ending = Renewal {
            sent_at: Instant::now() - Duration::from_millis(9_800),
            ttl_secs: 10,
        };
        task.known.learn(3, ending);
        let (reply, _rx) = oneshot::channel();
        task.refresh(3, Duration::ZERO, 10, true, reply);
        let (reply, _rx) = oneshot::channel();
        task.refresh(4, Duration::ZERO, 10, true, reply);
        assert!(task.probes.contains_key(&3) && task.probes.contains_key(&4));
        assert!(!task.queued.contains_key(&3) && !task.queued.contains_key(&4));
    }

    /// What the writer has put on the wire so far.
    macro_rules! wire {
        ($rx:expr) => {{
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            let mut sent = Vec::new();
            while let Ok(request) = $rx.try_recv() {
                sent.push(request.id);
            }
            sent
        }};
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_wait_for_the_next_burst_and_an_acquire_takes_it_at_once() {
        let (sender, mut wire) = mpsc::channel(MAX_BURST);
        let keeper = LeaseKeeper { id: 0, sender };
        let (tx, rx) = mpsc::channel(16);
        let (events, _events) = mpsc::unbounded_channel();
        let window = Duration::from_millis(20);
        tokio::spawn(write(keeper, rx, 1, events, ("t".into(), 0), window));
        // After a quiet spell a renewal's keepalive goes at once.
        tx.send((1, false)).await.unwrap();
        assert_eq!(wire!(wire), [1]);
        // The next waits for the burst 20 ms after that one...
        tx.send((2, false)).await.unwrap();
        assert_eq!(wire!(wire), [] as [i64; 0]);
        tokio::time::advance(Duration::from_millis(5)).await;
        assert_eq!(wire!(wire), [] as [i64; 0]);
        // ...unless an acquire's comes, which takes the burst with it.
        tx.send((3, true)).await.unwrap();
        assert_eq!(wire!(wire), [2, 3]);
        tx.send((4, false)).await.unwrap();
        tx.send((5, false)).await.unwrap();
        assert_eq!(wire!(wire), [] as [i64; 0]);
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(wire!(wire), [4, 5]);
    }
}
