//! Batched lock-key verification for renewals.
//!
//! A renewal must check that the lock key still belongs to the lockId. One
//! task per shard gathers those checks and sends them as read-only txns of up
//! to 128 gets (etcd's per-txn limit): linearizable reads, not raft writes.
//! Batching is opportunistic: no request waits for a timer; checks that
//! arrive while earlier batches are in flight simply share the next one.
//! Each batch also reads the shard's identity (`P/shard`): a batch sent to a
//! cluster that is not the shard the router verified answers nothing.

use std::sync::Arc;

use etcd_client::{Txn, TxnOp, TxnOpResponse};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::metrics as m;
use crate::shard::conn::{EtcdConn, EtcdError};
use crate::shard::keys::Stored;

/// The identity bytes the monitor verified on the shard, shared with the
/// verifier, which checks them on every batch of renewals.
pub type IdentityCell = Arc<std::sync::RwLock<Option<Vec<u8>>>>;

/// etcd's default `--max-txn-ops`.
pub const MAX_TXN_OPS: usize = 128;
/// Batches in flight at once per shard.
const CONCURRENT_BATCHES: usize = 4;

type Reply = oneshot::Sender<Result<Option<Stored>, EtcdError>>;

/// Handle to the shard's verification task; dropping it stops the task.
pub struct Verifier {
    tx: mpsc::Sender<(Vec<u8>, Reply)>,
    _task: crate::task::TaskGuard,
}

impl Verifier {
    pub fn start(
        conn: EtcdConn,
        identity_key: Vec<u8>,
        identity: IdentityCell,
        cancel: CancellationToken,
    ) -> Self {
        let (tx, rx) = mpsc::channel(16_384);
        let shard = Identified {
            conn,
            key: identity_key,
            verified: identity,
        };
        let task = tokio::spawn(run(shard, rx, cancel.clone()));
        Self {
            tx,
            _task: crate::task::TaskGuard::new(task, cancel),
        }
    }

    /// The current value of `key` (linearizable), or `None` if absent.
    pub async fn get(&self, key: Vec<u8>) -> Result<Option<Stored>, EtcdError> {
        let (reply, rx) = oneshot::channel();
        let gone = || EtcdError::Other {
            shard: String::new(),
            detail: "verification task stopped".into(),
        };
        self.tx.send((key, reply)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// The shard's connection and the identity its answers must come with.
#[derive(Clone)]
struct Identified {
    conn: EtcdConn,
    key: Vec<u8>,
    verified: IdentityCell,
}

async fn run(
    shard: Identified,
    mut rx: mpsc::Receiver<(Vec<u8>, Reply)>,
    cancel: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(CONCURRENT_BATCHES));
    let mut batches = JoinSet::new();
    loop {
        // Take a permit first: while every batch is busy, checks queue up and
        // the next batch carries more of them.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("semaphore is never closed"),
            _ = cancel.cancelled() => break,
        };
        let first = tokio::select! {
            item = rx.recv() => match item { Some(i) => i, None => break },
            _ = cancel.cancelled() => break,
        };
        let mut batch = vec![first];
        // One op of each txn reads the identity.
        while batch.len() < MAX_TXN_OPS - 1 {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let shard = shard.clone();
        batches.spawn(async move {
            check(&shard, batch).await;
            drop(permit);
        });
        while batches.try_join_next().is_some() {}
    }
}

async fn check(shard: &Identified, batch: Vec<(Vec<u8>, Reply)>) {
    let conn = &shard.conn;
    m::verify_batch(conn.shard(), batch.len());
    let mut ops: Vec<TxnOp> = batch
        .iter()
        .map(|(k, _)| TxnOp::get(k.clone(), None))
        .collect();
    ops.push(TxnOp::get(shard.key.clone(), None));
    // Read-only: hedged, so a silent member delays renewals by little.
    let txn = Txn::new().and_then(ops);
    let result = conn.txn_hedged(txn).await;
    let mut found: Vec<Option<Stored>> = match result {
        Ok(resp) => resp
            .op_responses()
            .into_iter()
            .map(|op| match op {
                TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next().map(Stored::from),
                _ => None,
            })
            .collect(),
        Err(e) => {
            for (_, reply) in batch {
                let _ = reply.send(Err(e.clone()));
            }
            return;
        }
    };
    let identity = found.pop().flatten();
    let verified = shard.verified.read().expect("identity lock").clone();
    if verified.is_none() || identity.as_ref().map(|kv| kv.value()) != verified.as_deref() {
        let e = conn.unavailable("the cluster does not carry this shard's verified identity");
        for (_, reply) in batch {
            let _ = reply.send(Err(e.clone()));
        }
        return;
    }
    for ((_, reply), kv) in batch.into_iter().zip(found) {
        let _ = reply.send(Ok(kv));
    }
}
