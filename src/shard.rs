//! A shard: one etcd cluster, and the etcd txns lockrouter runs on it.
//!
//! Besides its connection, a shard owns the background helpers that make the
//! hot paths cheap (the multiplexed keepalive stream, batched verification,
//! the session-lease cache) and the ring state it last read from etcd.
//! Every grant compares the shard's recorded ring byte for byte, so a router
//! whose ring differs from the shard's can never grant there.

use std::sync::RwLock;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use tokio_util::sync::CancellationToken;

use crate::etcd::{EtcdConn, EtcdError};
use crate::keepalive::Keepalive;
use crate::keys::{Keys, LockValue, Recorded};
use crate::session::Sessions;
use crate::verify::Verifier;

/// What this router knows of the ring recorded on the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingState {
    /// Not read yet (the shard has not answered).
    Unknown,
    /// The shard has no ring recorded yet.
    Absent,
    /// The shard records this router's ring: grants allowed.
    Ready(Recorded),
    /// The shard records another ring: grants refused.
    Mismatch(Recorded),
}

/// Outcome of the acquire txn.
pub enum AcquireTxn {
    /// The key was created at this revision (the token's low bits).
    Granted { revision: i64 },
    /// Someone (maybe the caller itself) holds the name.
    Held(KeyValue),
    /// Nobody holds it, but callers are queued for it (no barging).
    Queued,
    /// The shard's ring is not the one the router compared against.
    RingChanged(Option<Recorded>),
}

pub struct Shard {
    pub name: String,
    pub conn: EtcdConn,
    pub keys: Keys,
    pub keepalive: Keepalive,
    pub verifier: Verifier,
    pub sessions: Sessions,
    /// std `RwLock`: read on every acquire, written by the monitor, never
    /// held across an await.
    ring: RwLock<RingState>,
}

impl Shard {
    pub fn new(conn: EtcdConn, prefix: &str, cancel: &CancellationToken) -> Self {
        Self {
            name: conn.shard().to_string(),
            keys: Keys::new(prefix),
            keepalive: Keepalive::start(conn.clone(), cancel.child_token()),
            verifier: Verifier::start(conn.clone(), cancel.child_token()),
            sessions: Sessions::default(),
            ring: RwLock::new(RingState::Unknown),
            conn,
        }
    }

    pub fn ring_state(&self) -> RingState {
        self.ring.read().expect("ring lock").clone()
    }

    pub fn set_ring_state(&self, state: RingState) {
        *self.ring.write().expect("ring lock") = state;
    }

    /// Grants `key` to `lease` if nobody holds it and the shard still records
    /// `ring`; otherwise reads the holder and the recorded ring.
    pub async fn acquire_txn(
        &self,
        key: &[u8],
        value: Vec<u8>,
        lease: i64,
        ring: &Recorded,
        waiters: &[u8],
    ) -> Result<AcquireTxn, EtcdError> {
        let ring_key = self.keys.ring();
        let txn = Txn::new()
            .when([
                Compare::create_revision(key, CompareOp::Equal, 0),
                Compare::value(ring_key.clone(), CompareOp::Equal, ring.bytes.clone()),
                // No queued waiter: an empty range compares as revision 0.
                Compare::create_revision(waiters, CompareOp::Equal, 0).with_prefix(),
            ])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None), TxnOp::get(ring_key, None)]);
        let mut kv = self.conn.client().kv_client();
        let resp = self.conn.call("Txn", kv.txn(txn)).await?;
        if resp.succeeded() {
            let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
            return Ok(AcquireTxn::Granted { revision });
        }
        let mut gets = resp.op_responses().into_iter().map(|op| match op {
            TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next(),
            _ => None,
        });
        let holder = gets.next().flatten();
        let recorded = gets.next().flatten().map(|kv| Recorded::parse(kv.value()));
        match holder {
            _ if recorded.as_ref() != Some(ring) => Ok(AcquireTxn::RingChanged(recorded)),
            Some(kv) => Ok(AcquireTxn::Held(kv)),
            None => Ok(AcquireTxn::Queued),
        }
    }

    /// Deletes `key` only if it still has this create revision and lease.
    /// Returns whether it deleted.
    pub async fn release_txn(
        &self,
        key: &[u8],
        revision: i64,
        lease: i64,
    ) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(key, CompareOp::Equal, revision),
                Compare::lease(key, CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::delete(key, None)]);
        let mut kv = self.conn.client().kv_client();
        Ok(self.conn.call("Txn", kv.txn(txn)).await?.succeeded())
    }

    /// Linearizable read of one key.
    pub async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, EtcdError> {
        let mut kv = self.conn.client().kv_client();
        let mut resp = self.conn.call("Range", kv.get(key, None)).await?;
        Ok(resp.take_kvs().into_iter().next())
    }

    pub async fn grant(&self, ttl_secs: u32) -> Result<i64, EtcdError> {
        let mut lease = self.conn.client().lease_client();
        let resp = self
            .conn
            .call("LeaseGrant", lease.grant(ttl_secs.into(), None))
            .await?;
        Ok(resp.id())
    }

    /// Seconds the lease has left (rounded down by etcd); 0 if it is gone.
    pub async fn time_to_live(&self, lease: i64) -> Result<i64, EtcdError> {
        let mut client = self.conn.client().lease_client();
        let call = client.time_to_live(lease, Some(LeaseTimeToLiveOptions::new()));
        match self.conn.call("LeaseTimeToLive", call).await {
            Ok(resp) => Ok(resp.ttl().max(0)),
            Err(EtcdError::LeaseNotFound) => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Reads the recorded ring (also the health probe).
    pub async fn read_ring(&self) -> Result<Option<Recorded>, EtcdError> {
        let found = self.get(&self.keys.ring()).await?;
        Ok(found.map(|kv| Recorded::parse(kv.value())))
    }

    /// Replaces the recorded ring with `new` if it is still `expected`
    /// (`None`: no ring recorded). Returns what the shard records after.
    pub async fn swap_ring(
        &self,
        expected: Option<&[u8]>,
        new: &Recorded,
    ) -> Result<Option<Recorded>, EtcdError> {
        let key = self.keys.ring();
        let guard = match expected {
            None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            Some(bytes) => Compare::value(key.clone(), CompareOp::Equal, bytes.to_vec()),
        };
        let txn = Txn::new()
            .when([guard])
            .and_then([TxnOp::put(key.clone(), new.bytes.clone(), None)])
            .or_else([TxnOp::get(key, None)]);
        let mut kv = self.conn.client().kv_client();
        let resp = self.conn.call("Txn", kv.txn(txn)).await?;
        if resp.succeeded() {
            return Ok(Some(new.clone()));
        }
        Ok(first_kv(resp.op_responses()).map(|kv| Recorded::parse(kv.value())))
    }

    /// One linearizable read of a lock key and the recorded ring (the
    /// handoff check of a migration).
    pub async fn read_lock_and_ring(
        &self,
        key: &[u8],
    ) -> Result<(Option<KeyValue>, Option<Recorded>), EtcdError> {
        let txn = Txn::new().and_then([TxnOp::get(key, None), TxnOp::get(self.keys.ring(), None)]);
        let mut kv = self.conn.client().kv_client();
        let resp = self.conn.call("Txn", kv.txn(txn)).await?;
        let mut gets = resp.op_responses().into_iter().map(|op| match op {
            TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next(),
            _ => None,
        });
        let lock = gets.next().flatten();
        let ring = gets.next().flatten().map(|kv| Recorded::parse(kv.value()));
        Ok((lock, ring))
    }

    /// Counts the locks on this shard whose names satisfy `counts`, reading
    /// every lock key at one revision, a page at a time (no raft writes).
    pub async fn count_locks_where(
        &self,
        mut counts: impl FnMut(&str) -> bool,
    ) -> Result<i64, EtcdError> {
        let (start, end) = self.keys.locks_range();
        let mut from = start;
        let mut revision = 0;
        let mut total = 0;
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(1_000);
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let mut kv = self.conn.client().kv_client();
            let mut resp = self
                .conn
                .call("Range", kv.get(from.clone(), Some(opts)))
                .await?;
            if revision == 0 {
                revision = resp.header().map(|h| h.revision()).unwrap_or(0);
            }
            let more = resp.more();
            let kvs = resp.take_kvs();
            for kv in &kvs {
                if let Ok(v) = serde_json::from_slice::<LockValue>(kv.value()) {
                    total += i64::from(counts(&v.name));
                }
            }
            match kvs.last() {
                Some(last) if more => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(total),
            }
        }
    }

    /// Number of lock keys on the shard (a count-only range: no values read).
    pub async fn count_locks(&self) -> Result<i64, EtcdError> {
        let (start, end) = self.keys.locks_range();
        let mut kv = self.conn.client().kv_client();
        let opts = GetOptions::new().with_range(end).with_count_only();
        Ok(self
            .conn
            .call("Range", kv.get(start, Some(opts)))
            .await?
            .count())
    }
}

fn first_kv(ops: Vec<TxnOpResponse>) -> Option<KeyValue> {
    ops.into_iter().find_map(|op| match op {
        TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next(),
        _ => None,
    })
}
