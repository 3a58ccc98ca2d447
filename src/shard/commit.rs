//! Group commit: the acquires and releases of a shard that arrive while
//! earlier ones are in flight go to etcd as one txn of nested txns, one
//! raft write for all of them (`docs/design.md`, "Group commit").
//!
//! No request waits for a timer: a batch is whatever is waiting when the
//! batch in flight is answered, or, when a request comes to an idle shard,
//! once the runtime has run what it already had to do ([`next_job`]); a
//! second batch leaves beside it only while a full one waits
//! ([`MAX_IN_FLIGHT`]). Each acquire keeps its own compares in its
//! nested txn; the ring and identity are compared once, by the outer txn,
//! so only acquires that compare the same ring and identity share a batch.
//! A release compares no ring: if the ring compare fails, the batch's
//! releases are sent again alone. A name appears once per batch (etcd
//! refuses a key twice in one txn); a later acquire or release of it waits
//! for the next batch. A put naming a lease that is gone fails the whole
//! txn and applies nothing: the batch is then sent again in halves, until
//! only the acquire of the dead lease sees it.
//!
//! A batch's txn is bounded by the latest deadline of the requests it
//! serves (or the shard's deadline, if sooner), and an acquire whose caller
//! stopped waiting (its request timed out) is left out of the next batch:
//! nobody would learn of its grant.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse, TxnResponse};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::conn::{EtcdConn, EtcdError};
use super::keys::{Keys, LockValue, Recorded};
use super::name::{
    acquire_txn, classify_refusal, gets, grant_ops, name_compares, name_state, own_reads,
    refusal_or_cutoff, release_outcome, release_txn, revision, shard_compares,
};
use super::name::{AcquireTxn, Grantable, NameKeys, NameState, ReleaseTxn};

/// Most batches in flight at once per shard. Normally one: a second that
/// left as soon as anything waited would split the queue into two
/// half-size batches under load, each paying etcd's fixed cost per txn and
/// raft write (`docs/design.md`, "Group commit"; `docs/benchmarks.md`,
/// "One batch in flight"). A second leaves only while a full batch
/// ([`MAX_BATCH`]) waits, so that a slow etcd's round trip does not cap a
/// shard at one full batch per round trip.
pub const MAX_IN_FLIGHT: usize = 2;
/// Most grants and releases in one txn. etcd (`--max-txn-ops`, default
/// 128) counts a txn's ops and then gives each nested txn what is left:
/// 100 outer ops leave 28, far above the 4 a nested grant or release
/// needs. A batch that etcd refuses anyway (a lower limit,
/// `--max-request-bytes`) is sent again in halves.
const MAX_BATCH: usize = 100;
/// Largest answer a batch's txn may bring: up to [`MAX_BATCH`] lock values
/// (a refused grant's reads, a release's deleted key), each up to about
/// 70 KB with the largest `limits.max_metadata_bytes`, more than tonic's
/// 4 MiB default. An answer cut short would fail a txn etcd applied.
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// One acquire waiting for its batch.
pub struct AcquireJob {
    pub k: NameKeys,
    pub value: LockValue,
    pub lease: i64,
    pub g: Grantable,
    pub replace_held: Option<i64>,
    /// The deadline of the request it serves, if any.
    deadline: Option<Instant>,
    reply: oneshot::Sender<Result<AcquireTxn, EtcdError>>,
}

/// One release waiting for its batch.
pub struct ReleaseJob {
    pub k: NameKeys,
    pub revision: i64,
    pub lease: i64,
    /// The deadline of the request it serves, if any.
    deadline: Option<Instant>,
    reply: oneshot::Sender<Result<ReleaseTxn, EtcdError>>,
}

/// A grant or a release waiting for its batch (a grant's job is the larger
/// by far, and boxed so that the queue's slots stay small).
enum Job {
    Acquire(Box<AcquireJob>),
    Release(ReleaseJob),
}

impl Job {
    fn name(&self) -> &[u8] {
        match self {
            Job::Acquire(j) => &j.k.lock,
            Job::Release(j) => &j.k.lock,
        }
    }
}

/// Handle to a shard's committer task; dropping it stops it.
pub struct Committer {
    jobs: mpsc::Sender<Job>,
    /// Told when a full batch waits in `jobs`: the committer may then send
    /// it beside the batch in flight.
    full: Arc<Notify>,
    _task: crate::task::TaskGuard,
}

/// What the committer needs of the shard.
#[derive(Clone)]
struct Target {
    conn: EtcdConn,
    keys: Keys,
}

impl Committer {
    pub fn start(conn: EtcdConn, keys: Keys, cancel: &CancellationToken) -> Self {
        let target = Target { conn, keys };
        let (jobs, rx) = mpsc::channel(16_384);
        let full = Arc::new(Notify::new());
        let cancel = cancel.child_token();
        let task = tokio::spawn(run(target, rx, full.clone(), cancel.clone()));
        Self {
            jobs,
            full,
            _task: crate::task::TaskGuard::new(task, cancel),
        }
    }

    /// Queues `job`, and tells the committer if a full batch now waits
    /// (only then may it send one beside the batch in flight).
    async fn queue(&self, job: Job) -> Result<(), EtcdError> {
        self.jobs.send(job).await.map_err(|_| stopped())?;
        if self.jobs.max_capacity() - self.jobs.capacity() >= MAX_BATCH {
            self.full.notify_one();
        }
        Ok(())
    }

    /// Runs the grant txn of one acquire, in whatever batch it joins.
    pub async fn acquire(
        &self,
        k: &NameKeys,
        value: &LockValue,
        lease: i64,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<AcquireTxn, EtcdError> {
        let (reply, rx) = oneshot::channel();
        let job = AcquireJob {
            k: k.clone(),
            value: value.clone(),
            lease,
            g: g.clone(),
            replace_held,
            deadline: crate::task::request_deadline(),
            reply,
        };
        self.queue(Job::Acquire(Box::new(job))).await?;
        rx.await.map_err(|_| stopped())?
    }

    /// Runs the release txn of one lock, in whatever batch it joins.
    pub async fn release(
        &self,
        k: &NameKeys,
        revision: i64,
        lease: i64,
    ) -> Result<ReleaseTxn, EtcdError> {
        let (reply, rx) = oneshot::channel();
        let job = ReleaseJob {
            k: k.clone(),
            revision,
            lease,
            deadline: crate::task::request_deadline(),
            reply,
        };
        self.queue(Job::Release(job)).await?;
        rx.await.map_err(|_| stopped())?
    }
}

fn stopped() -> EtcdError {
    EtcdError::Other {
        shard: String::new(),
        detail: "committer task stopped".into(),
    }
}

async fn run(
    target: Target,
    mut rx: mpsc::Receiver<Job>,
    full: Arc<Notify>,
    cancel: CancellationToken,
) {
    // Jobs that could not join the last batch (an acquire under another
    // ring or identity, or a name already in it), first in line for the
    // next.
    let mut carried: VecDeque<Job> = VecDeque::new();
    let mut in_flight: JoinSet<()> = JoinSet::new();
    'run: loop {
        // Wait until nothing is in flight, or a full batch waits and a
        // second may leave beside the one in flight.
        while !in_flight.is_empty() {
            let may_add = in_flight.len() < MAX_IN_FLIGHT;
            if may_add && carried.len() + rx.len() >= MAX_BATCH {
                break;
            }
            tokio::select! {
                _ = in_flight.join_next() => {}
                _ = full.notified(), if may_add => {}
                _ = cancel.cancelled() => break 'run,
            }
        }
        let first = match carried.pop_front() {
            Some(job) => job,
            None => tokio::select! {
                job = next_job(&mut rx, in_flight.is_empty()) => match job {
                    Some(j) => j,
                    None => break 'run,
                },
                _ = cancel.cancelled() => break 'run,
            },
        };
        let mut batch = Batch::default();
        let mut waiting: VecDeque<Job> = std::mem::take(&mut carried);
        waiting.push_front(first);
        while batch.len() < MAX_BATCH {
            let job = match waiting.pop_front() {
                Some(job) => job,
                None => match rx.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                },
            };
            if let Some(job) = batch.join(job) {
                carried.push_back(job);
            }
        }
        carried.extend(waiting);
        let target = target.clone();
        in_flight.spawn(async move {
            target
                .conn
                .metrics()
                .commit_batch(batch.kind(), batch.len());
            commit(&target, batch.acquires, batch.releases).await;
        });
    }
    // Batches already sent are answered, as if the shard were still here.
    in_flight.detach_all();
}

/// The next job from `rx`, the first of a batch. When the shard is `idle`
/// (no batch in flight), it is handed on only after the runtime has run
/// what it already had to do: one yield, and tokio wakes a yielded task
/// once its worker has no other task to run and has looked for I/O (or at
/// its periodic look at I/O). So the requests whose bytes have arrived
/// meanwhile (under load, mostly the next requests of the clients the
/// last batch answered) join this batch instead of trailing a batch of
/// one (`docs/design.md`,
/// "Group commit"). No timer: the wait is bounded by the work already
/// queued on the runtime.
async fn next_job(rx: &mut mpsc::Receiver<Job>, idle: bool) -> Option<Job> {
    let job = rx.recv().await?;
    if idle {
        tokio::task::yield_now().await;
    }
    Some(job)
}

/// The jobs of one txn: distinct names, and acquires that compare the same
/// ring and identity.
#[derive(Default)]
struct Batch {
    acquires: Vec<AcquireJob>,
    releases: Vec<ReleaseJob>,
    names: HashSet<Vec<u8>>,
}

impl Batch {
    /// Adds `job`, or hands it back if it cannot share this batch's txn.
    fn join(&mut self, job: Job) -> Option<Job> {
        if let (Job::Acquire(j), Some(first)) = (&job, self.acquires.first()) {
            if j.g.ring != first.g.ring
                || j.g.identity != first.g.identity
                || j.g.cutoff != first.g.cutoff
            {
                return Some(job);
            }
        }
        if !self.names.insert(job.name().to_vec()) {
            return Some(job);
        }
        match job {
            Job::Acquire(j) => self.acquires.push(*j),
            Job::Release(j) => self.releases.push(j),
        }
        None
    }

    fn len(&self) -> usize {
        self.acquires.len() + self.releases.len()
    }

    /// The `kind` of its `lockrouter_commits_total`.
    fn kind(&self) -> &'static str {
        match (self.acquires.is_empty(), self.releases.is_empty()) {
            (false, true) => "acquire",
            (true, false) => "release",
            _ => "mixed",
        }
    }
}

/// Sends the batch as one txn (a single job as its own txn) and answers
/// each job. A dead lease in the batch fails the whole txn: then the batch
/// is sent again in halves.
async fn commit(target: &Target, mut acquires: Vec<AcquireJob>, releases: Vec<ReleaseJob>) {
    acquires.retain(|j| !j.reply.is_closed());
    let deadline = latest(
        acquires
            .iter()
            .map(|j| j.deadline)
            .chain(releases.iter().map(|j| j.deadline)),
    );
    match (acquires.len(), releases.len()) {
        (0, 0) => return,
        (1, 0) => {
            let job = acquires.pop().expect("one acquire");
            let txn = acquire_txn(
                &target.keys,
                &job.k,
                &job.value,
                job.lease,
                &job.g,
                job.replace_held,
            );
            let result = call(target, txn, deadline)
                .await
                .map(|resp| single_outcome(resp, &target.keys, &job.g));
            let _ = job.reply.send(result);
            return;
        }
        (0, 1) => {
            let job = releases.into_iter().next().expect("one release");
            let txn = release_txn(&job.k, job.revision, job.lease);
            let outcome = call(target, txn, deadline).await;
            let _ = job.reply.send(outcome.map(|r| release_outcome(&r)));
            return;
        }
        _ => {}
    }
    match call(
        target,
        batch_txn(&target.keys, &acquires, &releases),
        deadline,
    )
    .await
    {
        Ok(resp) => {
            let unsent = answer(resp, &target.keys, acquires, releases);
            if !unsent.is_empty() {
                Box::pin(commit(target, Vec::new(), unsent)).await;
            }
        }
        // A dead lease (or anything else etcd refuses in one of the jobs)
        // fails the whole txn and applies nothing: halve until it reaches
        // only the jobs it concerns.
        Err(EtcdError::LeaseNotFound | EtcdError::Other { .. }) => {
            let jobs: Vec<Job> = acquires
                .into_iter()
                .map(|j| Job::Acquire(Box::new(j)))
                .chain(releases.into_iter().map(Job::Release))
                .collect();
            let (a, b) = halves(jobs);
            let (a, b) = (split(a), split(b));
            futures::future::join(
                Box::pin(commit(target, a.0, a.1)),
                Box::pin(commit(target, b.0, b.1)),
            )
            .await;
        }
        Err(e) => {
            for job in acquires {
                let _ = job.reply.send(Err(e.clone()));
            }
            for job in releases {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
    }
}

/// A batch's txn: releases alone as nested txns under no compare; with
/// acquires, the ring and identity compared once by the outer txn, and
/// each acquire's and release's nested txn in its `Then`. If the compare
/// fails, nothing applies: the acquires are answered from the `Else`'s
/// reads, and the releases are sent again alone.
fn batch_txn(k: &Keys, acquires: &[AcquireJob], releases: &[ReleaseJob]) -> Txn {
    let released = releases
        .iter()
        .map(|j| TxnOp::txn(release_txn(&j.k, j.revision, j.lease)));
    let Some(first) = acquires.first() else {
        return Txn::new().and_then(released.collect::<Vec<_>>());
    };
    let granted = acquires
        .iter()
        .map(|j| TxnOp::txn(nested_acquire(&j.k, &j.value, j.lease, j.replace_held)));
    let mut when = shard_compares(k, &first.g).to_vec();
    when.push(k.cutoff_compare(first.g.cutoff));
    Txn::new()
        .when(when)
        .and_then(granted.chain(released).collect::<Vec<_>>())
        .or_else([
            TxnOp::get(k.ring(), None),
            TxnOp::get(k.identity(), None),
            k.cutoff_read(),
        ])
}

/// Answers each job of a batch from its txn's answer: the acquires' nested
/// answers (or the outer `Else`'s ring, identity and cut-off), then the
/// releases'; returns the releases that did not run (the outer compare
/// failed).
#[must_use]
fn answer(
    resp: TxnResponse,
    keys: &Keys,
    acquires: Vec<AcquireJob>,
    releases: Vec<ReleaseJob>,
) -> Vec<ReleaseJob> {
    let granted_at = revision(&resp);
    if !resp.succeeded() {
        // The ring, the identity or the cut-off changed: every acquire
        // sees it.
        let mut reads = gets(resp);
        let ring = reads.next().flatten().map(|kv| Recorded::parse(kv.value()));
        let identity = reads.next().flatten().map(|kv| kv.value().to_vec());
        let cutoff = keys.cutoff_of(reads.next().flatten());
        for job in acquires {
            let outcome = if identity.as_deref() != Some(job.g.identity.as_slice()) {
                AcquireTxn::IdentityChanged
            } else if ring.as_ref() != Some(&job.g.ring) || cutoff <= job.g.cutoff {
                AcquireTxn::RingChanged(ring.clone())
            } else {
                AcquireTxn::CutoffMoved(cutoff)
            };
            let _ = job.reply.send(Ok(outcome));
        }
        return releases;
    }
    let mut ops = resp.op_responses().into_iter();
    for (job, op) in acquires.into_iter().zip(ops.by_ref()) {
        let outcome = match op {
            TxnOpResponse::Txn(inner) if inner.succeeded() => AcquireTxn::Granted {
                revision: granted_at,
            },
            TxnOpResponse::Txn(inner) => nested_refusal(inner, &job.g),
            _ => AcquireTxn::Queued, // not an answer a nested txn gives
        };
        let _ = job.reply.send(Ok(outcome));
    }
    for (job, op) in releases.into_iter().zip(ops) {
        let outcome = match op {
            TxnOpResponse::Txn(inner) => release_outcome(&inner),
            _ => ReleaseTxn::NotHeld, // not an answer a nested txn gives
        };
        let _ = job.reply.send(Ok(outcome));
    }
    Vec::new()
}

/// A batch's jobs back in their two kinds.
fn split(jobs: Vec<Job>) -> (Vec<AcquireJob>, Vec<ReleaseJob>) {
    let (mut acquires, mut releases) = (Vec::new(), Vec::new());
    for job in jobs {
        match job {
            Job::Acquire(j) => acquires.push(*j),
            Job::Release(j) => releases.push(j),
        }
    }
    (acquires, releases)
}

/// Splits a batch of two or more in two non-empty halves.
fn halves<T>(mut batch: Vec<T>) -> (Vec<T>, Vec<T>) {
    let second = batch.split_off(batch.len() / 2);
    (batch, second)
}

/// One acquire's nested txn: its own compares and ops; the ring and
/// identity are the outer txn's.
fn nested_acquire(k: &NameKeys, value: &LockValue, lease: i64, replace_held: Option<i64>) -> Txn {
    let mut when = name_compares(k, replace_held);
    when.push(Compare::create_revision(k.waiters.clone(), CompareOp::Equal, 0).with_prefix());
    Txn::new()
        .when(when)
        .and_then(grant_ops(k, value, lease))
        .or_else(own_reads(k))
}

/// Why a nested acquire did not grant (the outer txn's compares held).
fn nested_refusal(inner: TxnResponse, g: &Grantable) -> AcquireTxn {
    let mut reads = gets(inner);
    let mut next = || reads.next().flatten();
    let state = NameState {
        lock: next(),
        held: next(),
        delay: next(),
        ring: Some(g.ring.clone()),
        identity: Some(g.identity.clone()),
    };
    classify_refusal(state, g).unwrap_or(AcquireTxn::Queued)
}

fn single_outcome(resp: TxnResponse, keys: &Keys, g: &Grantable) -> AcquireTxn {
    if resp.succeeded() {
        return AcquireTxn::Granted {
            revision: revision(&resp),
        };
    }
    let mut reads = gets(resp);
    let state = name_state(&mut reads);
    refusal_or_cutoff(state, keys.cutoff_of(reads.next().flatten()), g)
}

/// The latest of the batch's request deadlines; `None` if one of its jobs
/// has none (it then waits as long as the shard's deadline).
fn latest(deadlines: impl Iterator<Item = Option<Instant>>) -> Option<Instant> {
    let mut latest: Option<Instant> = None;
    for d in deadlines {
        let d = d?;
        latest = Some(latest.map_or(d, |l| l.max(d)));
    }
    latest
}

/// Sends `txn` under `deadline` (see [`latest`]) or the shard's.
async fn call(
    target: &Target,
    txn: Txn,
    deadline: Option<Instant>,
) -> Result<TxnResponse, EtcdError> {
    let mut kv = target
        .conn
        .client()
        .kv_client()
        .max_decoding_message_size(MAX_ANSWER_BYTES);
    let call = target.conn.call("Txn", kv.txn(txn));
    match deadline {
        Some(d) => crate::task::under_deadline(d, call).await,
        None => call.await,
    }
}

#[cfg(test)]
mod tests {
    use super::{halves, latest, AcquireJob, Batch, Job, ReleaseJob};
    use crate::keys::RingMeta;
    use crate::shard::keys::{name_hash, Keys, LockValue, Recorded};
    use crate::shard::name::{Grantable, NameKeys};
    use std::time::{Duration, Instant};
    use tokio::sync::oneshot;

    fn keys(name: &str) -> NameKeys {
        NameKeys::new(&Keys::new("/t"), &name_hash(name))
    }

    fn grantable(ring: &str) -> Grantable {
        let meta = RingMeta {
            epoch: 1,
            ring: ring.into(),
            previous: None,
        };
        Grantable {
            ring: Recorded::new(meta),
            identity: b"shard a".to_vec(),
            cutoff: 0,
        }
    }

    fn acquire(name: &str, ring: &str) -> Job {
        let value = LockValue {
            client: "c".into(),
            epoch: 1,
            name: name.into(),
            ttl: 10,
            at: 0,
            meta: None,
        };
        Job::Acquire(Box::new(AcquireJob {
            k: keys(name),
            value,
            lease: 1,
            g: grantable(ring),
            replace_held: None,
            deadline: None,
            reply: oneshot::channel().0,
        }))
    }

    fn release(name: &str) -> Job {
        Job::Release(ReleaseJob {
            k: keys(name),
            revision: 5,
            lease: 1,
            deadline: None,
            reply: oneshot::channel().0,
        })
    }

    /// An idle shard's first job is handed on once the tasks the runtime
    /// already had to run have queued theirs, so they share its batch. On
    /// one worker this is deterministic: without the yield, the task a
    /// send wakes runs next (tokio's LIFO slot), and the batch would hold
    /// the first job alone.
    #[test]
    fn an_idle_shards_first_job_waits_for_the_jobs_already_on_their_way() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let (together, alone) = runtime.block_on(async {
            let mut taken = Vec::new();
            for idle in [true, false] {
                let (tx, mut rx) = tokio::sync::mpsc::channel(64);
                let committer = tokio::spawn(async move {
                    let _first = super::next_job(&mut rx, idle).await.expect("a job");
                    let mut jobs = 1;
                    while rx.try_recv().is_ok() {
                        jobs += 1;
                    }
                    jobs
                });
                tokio::time::sleep(Duration::from_millis(20)).await;
                // Five requests' tasks, runnable at once on the worker.
                tokio::spawn(async move {
                    for i in 0..5 {
                        let tx = tx.clone();
                        let job = acquire(&format!("n{i}"), "ring-1");
                        tokio::spawn(async move { tx.send(job).await.is_ok() });
                    }
                });
                taken.push(committer.await.expect("the committer"));
            }
            (taken[0], taken[1])
        });
        assert_eq!(together, 5, "jobs queued in the same turn share the batch");
        // The same setup without the yield (a batch in flight): the woken
        // committer runs first, so the setup does tell the two apart.
        assert_eq!(alone, 1, "no yield: the woken committer runs first");
    }

    #[test]
    fn a_batch_holds_each_name_once_and_one_ring_but_releases_of_any() {
        let mut b = Batch::default();
        assert!(b.join(release("r")).is_none());
        assert_eq!(b.kind(), "release");
        assert!(b.join(acquire("x", "ring-1")).is_none());
        assert_eq!(b.kind(), "mixed");
        // A name already in the batch waits for the next, whichever kind.
        assert!(b.join(release("x")).is_some());
        assert!(b.join(acquire("r", "ring-1")).is_some());
        // An acquire comparing another ring waits; a release compares none.
        assert!(b.join(acquire("y", "ring-2")).is_some());
        assert!(b.join(release("z")).is_none());
        assert!(b.join(acquire("y", "ring-1")).is_none());
        assert_eq!((b.acquires.len(), b.releases.len(), b.len()), (2, 2, 4));
        let mut a = Batch::default();
        assert!(a.join(acquire("x", "ring-2")).is_none());
        assert_eq!(a.kind(), "acquire");
    }

    #[test]
    fn a_batch_waits_for_its_latest_deadline_and_none_means_the_shards() {
        let now = Instant::now();
        let (a, b) = (now + Duration::from_secs(1), now + Duration::from_secs(2));
        assert_eq!(latest([Some(a), Some(b), Some(a)].into_iter()), Some(b));
        assert_eq!(latest([Some(b), None, Some(a)].into_iter()), None);
        assert_eq!(latest([None].into_iter()), None);
    }

    #[test]
    fn halves_are_non_empty_and_keep_every_job_once_in_order() {
        for n in 2..40 {
            let (a, b) = halves((0..n).collect::<Vec<_>>());
            assert!(!a.is_empty() && !b.is_empty(), "{n}");
            assert_eq!([a, b].concat(), (0..n).collect::<Vec<_>>());
        }
    }
}
