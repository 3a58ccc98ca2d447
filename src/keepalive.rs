//! Coalesced lease keepalives over one gRPC stream per shard.
//!
//! etcd-client's `lease_keep_alive(id)` opens a stream per lease, but etcd's
//! KeepAlive stream accepts any lease id, so one task per shard owns a single
//! stream and multiplexes every lease over it. Renewals of one lease are
//! coalesced: while a keepalive for it is in flight, or one was confirmed
//! less than the caller's window ago, no new keepalive is sent.
//!
//! Honest expiry: a [`Renewal`] counts the lease's time from the instant the
//! keepalive (or grant) was *sent*, never from when etcd answered, so the
//! deadline it reports is never later than etcd's own.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::etcd::{EtcdConn, EtcdError};
use crate::metrics as m;

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
}

type Reply = oneshot::Sender<Result<Renewal, EtcdError>>;

enum Msg {
    Refresh {
        lease: i64,
        window: Duration,
        reply: Reply,
    },
    /// A lease was just granted: its grant counts as a keepalive.
    Seed { lease: i64, renewal: Renewal },
}

enum Event {
    Response { id: i64, ttl: i64 },
    Ended { generation: u64, detail: String },
}

/// Handle to the shard's keepalive task; dropping it stops the task.
pub struct Keepalive {
    tx: mpsc::Sender<Msg>,
    /// Longest a caller waits for an answer (a fail-over may send twice).
    deadline: Duration,
    shard: String,
    _task: crate::TaskGuard,
}

impl Keepalive {
    pub fn start(conn: EtcdConn, cancel: CancellationToken) -> Self {
        let (tx, rx) = mpsc::channel(4096);
        let deadline = conn.timeout() * 2;
        let shard = conn.shard().to_string();
        let task = tokio::spawn(Task::new(conn.clone()).run(rx, cancel.clone()));
        Self {
            tx,
            deadline,
            shard,
            _task: crate::TaskGuard::new(task, cancel),
        }
    }

    /// Renews `lease` unless a keepalive for it is in flight or was sent less
    /// than `window` ago; answers with what the router then knows.
    pub async fn refresh(&self, lease: i64, window: Duration) -> Result<Renewal, EtcdError> {
        let (reply, rx) = oneshot::channel();
        let gone = || EtcdError::Other {
            shard: String::new(),
            detail: "keepalive task stopped".into(),
        };
        self.tx
            .send(Msg::Refresh {
                lease,
                window,
                reply,
            })
            .await
            .map_err(|_| gone())?;
        match tokio::time::timeout(self.deadline, rx).await {
            Ok(answer) => answer.map_err(|_| gone())?,
            Err(_) => Err(EtcdError::Unavailable {
                shard: self.shard.clone(),
                detail: "no keepalive answer in time".into(),
            }),
        }
    }

    pub async fn seed(&self, lease: i64, renewal: Renewal) {
        let _ = self.tx.send(Msg::Seed { lease, renewal }).await;
    }
}

struct Inflight {
    sent_at: Instant,
    waiters: Vec<Reply>,
    /// Already re-sent once after a broken stream.
    retried: bool,
}

struct Stream {
    keeper: LeaseKeeper,
    generation: u64,
    reader: JoinHandle<()>,
}

struct Task {
    conn: EtcdConn,
    stream: Option<Stream>,
    generation: u64,
    inflight: HashMap<i64, Inflight>,
    /// Last confirmed renewal per live lease (pruned once expired).
    recent: HashMap<i64, Renewal>,
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
}

impl Task {
    fn new(conn: EtcdConn) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        Self {
            conn,
            stream: None,
            generation: 0,
            inflight: HashMap::new(),
            recent: HashMap::new(),
            events_tx,
            events_rx,
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<Msg>, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(Msg::Refresh { lease, window, reply }) => self.refresh(lease, window, reply).await,
                    Some(Msg::Seed { lease, renewal }) => { self.recent.insert(lease, renewal); }
                    None => break,
                },
                Some(ev) = self.events_rx.recv() => self.on_event(ev).await,
                _ = tick.tick() => self.on_tick().await,
                _ = cancel.cancelled() => break,
            }
        }
        self.reset("shutting down");
    }

    async fn refresh(&mut self, lease: i64, window: Duration, reply: Reply) {
        m::lease_renewals(self.conn.shard(), 1);
        if let Some(r) = self.recent.get(&lease) {
            if r.sent_at.elapsed() < window {
                let _ = reply.send(Ok(*r));
                return;
            }
        }
        if let Some(inflight) = self.inflight.get_mut(&lease) {
            inflight.waiters.push(reply);
            return;
        }
        let sent_at = Instant::now();
        match self.send(lease).await {
            Ok(()) => {
                m::keepalive_sent(self.conn.shard());
                self.inflight.insert(
                    lease,
                    Inflight {
                        sent_at,
                        waiters: vec![reply],
                        retried: false,
                    },
                );
            }
            Err(EtcdError::LeaseNotFound) => {
                self.recent.remove(&lease);
                let _ = reply.send(Ok(Renewal {
                    sent_at,
                    ttl_secs: 0,
                }));
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Sends one keepalive for `lease`, opening the stream first if needed.
    async fn send(&mut self, lease: i64) -> Result<(), EtcdError> {
        if self.stream.is_none() {
            self.open(lease).await?;
        }
        let stream = self.stream.as_mut().expect("opened above");
        stream.keeper.id = lease;
        let sent = tokio::time::timeout(self.conn.timeout(), stream.keeper.keep_alive()).await;
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                let err = self.conn.classify(e);
                self.reset(&err.to_string());
                Err(err)
            }
            Err(_) => {
                self.reset("keepalive send timed out");
                Err(self.conn.unavailable("keepalive send timed out"))
            }
        }
    }

    /// Opens the shared stream. etcd-client's opener sends a first keepalive
    /// for `lease` and consumes its answer; the caller sends it again so the
    /// answer reaches the waiters through the reader.
    async fn open(&mut self, lease: i64) -> Result<(), EtcdError> {
        let mut client = self.conn.client().lease_client();
        let (keeper, stream) = self
            .conn
            .call("LeaseKeepAlive", client.keep_alive(lease))
            .await?;
        self.generation += 1;
        let generation = self.generation;
        let reader = tokio::spawn(read(stream, generation, self.events_tx.clone()));
        self.stream = Some(Stream {
            keeper,
            generation,
            reader,
        });
        m::keepalive_sent(self.conn.shard());
        Ok(())
    }

    async fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Response { id, ttl } => {
                let Some(inflight) = self.inflight.remove(&id) else {
                    return;
                };
                let renewal = Renewal {
                    sent_at: inflight.sent_at,
                    ttl_secs: ttl,
                };
                if renewal.alive() {
                    self.recent.insert(id, renewal);
                } else {
                    self.recent.remove(&id);
                }
                for w in inflight.waiters {
                    let _ = w.send(Ok(renewal));
                }
            }
            Event::Ended { generation, detail } => {
                if self.stream.as_ref().map(|s| s.generation) == Some(generation) {
                    self.fail_over(&detail).await;
                }
            }
        }
    }

    async fn on_tick(&mut self) {
        let now = Instant::now();
        self.recent.retain(|_, r| r.deadline() > now);
        let timeout = self.conn.timeout();
        if self
            .inflight
            .values()
            .any(|i| i.sent_at.elapsed() > timeout)
        {
            self.fail_over("keepalive answers overdue").await;
        }
    }

    /// The stream broke (a member died, a connection reset) or went silent:
    /// send what was in flight once more on a fresh stream, which the client
    /// opens to a live member. Only keepalives that fail twice are reported
    /// unavailable. The new send instant counts for the deadline, since the
    /// answer will be to that send.
    async fn fail_over(&mut self, detail: &str) {
        if let Some(s) = self.stream.take() {
            s.reader.abort();
        }
        let pending: Vec<(i64, Inflight)> = self.inflight.drain().collect();
        for (lease, inflight) in pending {
            if inflight.retried {
                self.fail(inflight.waiters, detail);
                continue;
            }
            let sent_at = Instant::now();
            match self.send(lease).await {
                Ok(()) => {
                    let waiters = inflight.waiters;
                    let retried = true;
                    self.inflight.insert(
                        lease,
                        Inflight {
                            sent_at,
                            waiters,
                            retried,
                        },
                    );
                }
                Err(EtcdError::LeaseNotFound) => {
                    for w in inflight.waiters {
                        let _ = w.send(Ok(Renewal {
                            sent_at,
                            ttl_secs: 0,
                        }));
                    }
                }
                Err(e) => self.fail(inflight.waiters, &e.to_string()),
            }
        }
    }

    fn fail(&self, waiters: Vec<Reply>, detail: &str) {
        for w in waiters {
            let _ = w.send(Err(self
                .conn
                .unavailable(format!("keepalive stream: {detail}"))));
        }
    }

    /// Drops the stream and fails everything waiting on it.
    fn reset(&mut self, detail: &str) {
        if let Some(s) = self.stream.take() {
            s.reader.abort();
        }
        let pending: Vec<Inflight> = self.inflight.drain().map(|(_, i)| i).collect();
        for inflight in pending {
            self.fail(inflight.waiters, detail);
        }
    }
}

async fn read(mut stream: LeaseKeepAliveStream, generation: u64, tx: mpsc::UnboundedSender<Event>) {
    let detail = loop {
        match stream.message().await {
            Ok(Some(resp)) => {
                if tx
                    .send(Event::Response {
                        id: resp.id(),
                        ttl: resp.ttl(),
                    })
                    .is_err()
                {
                    return;
                }
            }
            Ok(None) => break "stream closed by etcd".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    let _ = tx.send(Event::Ended { generation, detail });
}
