//! Group commit: the acquires (and, apart, the releases) of a shard that
//! arrive while earlier ones are in flight go to etcd as one txn of nested
//! txns, one raft write for all of them (`docs/design.md`, "Group
//! commit").
//!
//! No request waits for a timer: a batch is whatever is waiting when a slot
//! frees (at most [`IN_FLIGHT`] batches in flight per kind). Each acquire
//! keeps its own compares in its nested txn; the ring and identity are
//! compared once, by the outer txn, so only acquires that compare the same
//! ring and identity share a batch. A name appears once per batch (etcd
//! refuses a key twice in one txn); a later acquire of it waits for the
//! next batch. A put naming a lease that is gone fails the whole txn and
//! applies nothing: the batch is then sent again in halves, until only the
//! acquire of the dead lease sees it.
//!
//! A batch's txn is bounded by the latest deadline of the requests it
//! serves (or the shard's deadline, if sooner), and an acquire whose caller
//! stopped waiting (its request timed out) is left out of the next batch:
//! nobody would learn of its grant.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse, TxnResponse};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_util::sync::CancellationToken;

use super::conn::{EtcdConn, EtcdError};
use super::keys::{Keys, LockValue, Recorded};
use super::name::{
    acquire_txn, classify_refusal, gets, grant_ops, name_compares, name_state, own_reads,
    release_outcome, release_txn, revision, shard_compares,
};
use super::name::{AcquireTxn, Grantable, NameKeys, NameState, ReleaseTxn};

/// Batches of each kind in flight at once per shard. More than one, so
/// that at low load an acquire never waits behind another's round trip.
pub const IN_FLIGHT: usize = 2;
/// Most grants or releases in one txn. etcd (`--max-txn-ops`, default
/// 128) counts a txn's ops and then gives each nested txn what is left:
/// 100 outer ops leave 28, far above the 4 a nested grant needs. A batch
/// that etcd refuses anyway (a lower limit, `--max-request-bytes`) is sent
/// again in halves.
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

/// Handle to a shard's committer tasks; dropping it stops them.
pub struct Committer {
    acquires: mpsc::Sender<AcquireJob>,
    releases: mpsc::Sender<ReleaseJob>,
    _acquire_task: crate::task::TaskGuard,
    _release_task: crate::task::TaskGuard,
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
        let (acquires, arx) = mpsc::channel(16_384);
        let (releases, rrx) = mpsc::channel(16_384);
        let (ac, rc) = (cancel.child_token(), cancel.child_token());
        let a = tokio::spawn(run_acquires(target.clone(), arx, ac.clone()));
        let r = tokio::spawn(run_releases(target, rrx, rc.clone()));
        Self {
            acquires,
            releases,
            _acquire_task: crate::task::TaskGuard::new(a, ac),
            _release_task: crate::task::TaskGuard::new(r, rc),
        }
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
        self.acquires.send(job).await.map_err(|_| stopped())?;
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
        self.releases.send(job).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}

fn stopped() -> EtcdError {
    EtcdError::Other {
        shard: String::new(),
        detail: "committer task stopped".into(),
    }
}

async fn run_acquires(
    target: Target,
    mut rx: mpsc::Receiver<AcquireJob>,
    cancel: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    // Jobs that could not join the last batch (another ring, or a name
    // already in it), first in line for the next.
    let mut carried: VecDeque<AcquireJob> = VecDeque::new();
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("semaphore is never closed"),
            _ = cancel.cancelled() => return,
        };
        let first = match carried.pop_front() {
            Some(job) => job,
            None => tokio::select! {
                job = rx.recv() => match job { Some(j) => j, None => return },
                _ = cancel.cancelled() => return,
            },
        };
        let mut names: HashSet<Vec<u8>> = HashSet::from([first.k.lock.clone()]);
        let mut batch = vec![first];
        let mut waiting: VecDeque<AcquireJob> = std::mem::take(&mut carried);
        while batch.len() < MAX_BATCH {
            let job = match waiting.pop_front() {
                Some(job) => job,
                None => match rx.try_recv() {
                    Ok(job) => job,
                    Err(_) => break,
                },
            };
            let same = job.g.ring == batch[0].g.ring && job.g.identity == batch[0].g.identity;
            if same && names.insert(job.k.lock.clone()) {
                batch.push(job);
            } else {
                carried.push_back(job);
            }
        }
        carried.extend(waiting);
        let target = target.clone();
        tokio::spawn(async move {
            crate::metrics::commit_batch(target.conn.shard(), "acquire", batch.len());
            commit_acquires(&target, batch).await;
            drop(slot);
        });
    }
}

/// Sends `batch` as one txn (a single acquire as its own txn), and answers
/// each job. A dead lease in the batch fails the whole txn: then the batch
/// is sent again in halves.
async fn commit_acquires(target: &Target, mut batch: Vec<AcquireJob>) {
    batch.retain(|j| !j.reply.is_closed());
    if batch.is_empty() {
        return;
    }
    let deadline = latest(batch.iter().map(|j| j.deadline));
    if batch.len() == 1 {
        let job = batch.into_iter().next().expect("one job");
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
            .map(|resp| single_outcome(resp, &job.g));
        let _ = job.reply.send(result);
        return;
    }
    let g = batch[0].g.clone();
    let nested: Vec<TxnOp> = batch
        .iter()
        .map(|j| TxnOp::txn(nested_acquire(&j.k, &j.value, j.lease, j.replace_held)))
        .collect();
    let k = &target.keys;
    let txn = Txn::new()
        .when(shard_compares(k, &g))
        .and_then(nested)
        .or_else([TxnOp::get(k.ring(), None), TxnOp::get(k.identity(), None)]);
    match call(target, txn, deadline).await {
        Ok(resp) if resp.succeeded() => {
            let granted_at = revision(&resp);
            for (job, op) in batch.into_iter().zip(resp.op_responses()) {
                let outcome = match op {
                    TxnOpResponse::Txn(inner) if inner.succeeded() => AcquireTxn::Granted {
                        revision: granted_at,
                    },
                    TxnOpResponse::Txn(inner) => nested_refusal(inner, &job.g),
                    _ => AcquireTxn::Queued, // not an answer a nested txn gives
                };
                let _ = job.reply.send(Ok(outcome));
            }
        }
        Ok(resp) => {
            // The ring or the identity changed: every acquire sees it.
            let mut reads = gets(resp);
            let ring = reads.next().flatten().map(|kv| Recorded::parse(kv.value()));
            let identity = reads.next().flatten().map(|kv| kv.value().to_vec());
            for job in batch {
                let outcome = if identity.as_deref() != Some(job.g.identity.as_slice()) {
                    AcquireTxn::IdentityChanged
                } else {
                    AcquireTxn::RingChanged(ring.clone())
                };
                let _ = job.reply.send(Ok(outcome));
            }
        }
        // A dead lease (or anything else etcd refuses in one of the jobs)
        // fails the whole txn and applies nothing: halve until it reaches
        // only the jobs it concerns.
        Err(EtcdError::LeaseNotFound | EtcdError::Other { .. }) => {
            let (a, b) = halves(batch);
            futures::future::join(
                Box::pin(commit_acquires(target, a)),
                Box::pin(commit_acquires(target, b)),
            )
            .await;
        }
        Err(e) => {
            for job in batch {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
    }
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

fn single_outcome(resp: TxnResponse, g: &Grantable) -> AcquireTxn {
    if resp.succeeded() {
        return AcquireTxn::Granted {
            revision: revision(&resp),
        };
    }
    classify_refusal(name_state(&mut gets(resp)), g).unwrap_or(AcquireTxn::Queued)
}

async fn run_releases(
    target: Target,
    mut rx: mpsc::Receiver<ReleaseJob>,
    cancel: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut carried: Option<ReleaseJob> = None;
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("semaphore is never closed"),
            _ = cancel.cancelled() => return,
        };
        let first = match carried.take() {
            Some(job) => job,
            None => tokio::select! {
                job = rx.recv() => match job { Some(j) => j, None => return },
                _ = cancel.cancelled() => return,
            },
        };
        let mut names: HashSet<Vec<u8>> = HashSet::from([first.k.lock.clone()]);
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            let Ok(job) = rx.try_recv() else { break };
            if names.insert(job.k.lock.clone()) {
                batch.push(job);
            } else {
                carried = Some(job);
                break;
            }
        }
        let target = target.clone();
        tokio::spawn(async move {
            crate::metrics::commit_batch(target.conn.shard(), "release", batch.len());
            commit_releases(&target, batch).await;
            drop(slot);
        });
    }
}

/// Sends `batch` as one txn of nested release txns (a single release as
/// its own txn) and answers what each did.
async fn commit_releases(target: &Target, batch: Vec<ReleaseJob>) {
    let deadline = latest(batch.iter().map(|j| j.deadline));
    if batch.len() == 1 {
        let job = batch.into_iter().next().expect("one job");
        let txn = release_txn(&job.k, job.revision, job.lease);
        let outcome = call(target, txn, deadline).await;
        let _ = job.reply.send(outcome.map(|r| release_outcome(&r)));
        return;
    }
    let nested: Vec<TxnOp> = batch
        .iter()
        .map(|j| TxnOp::txn(release_txn(&j.k, j.revision, j.lease)))
        .collect();
    match call(target, Txn::new().and_then(nested), deadline).await {
        Ok(resp) => {
            for (job, op) in batch.into_iter().zip(resp.op_responses()) {
                let outcome = match op {
                    TxnOpResponse::Txn(inner) => release_outcome(&inner),
                    _ => ReleaseTxn::NotHeld, // not an answer a nested txn gives
                };
                let _ = job.reply.send(Ok(outcome));
            }
        }
        Err(EtcdError::Other { .. }) => {
            let (a, b) = halves(batch);
            futures::future::join(
                Box::pin(commit_releases(target, a)),
                Box::pin(commit_releases(target, b)),
            )
            .await;
        }
        Err(e) => {
            for job in batch {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
    }
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
    use super::{halves, latest};
    use std::time::{Duration, Instant};

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
