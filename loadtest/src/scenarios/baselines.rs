//! The baselines, sent straight to the same etcd shards with etcd-client:
//!
//! - `direct`: the router's own grant and release txns, with the same
//!   compares, writes and reads (see [`acquire_txn`]), on a lease granted
//!   once per shard as a router session would be. No HTTP, no router, no
//!   group commit: one txn per acquire and per release, the physical limit
//!   of this machine for that work.
//! - `naive`: one lease per lock, the design lockrouter replaces: grant, then
//!   the same grant txn on that lease without the held record (the lease is
//!   the lock's only record); release revokes the lease (which deletes the
//!   key). [`naive_hold`] holds leases the naive way, one keepalive per lock
//!   every TTL/3, to count what that costs etcd.
//!
//! - `barrier`: the router's lock-key cache barrier alone (a txn that
//!   compares the shard's identity and puts the barrier key, inside a
//!   watched range, as the router's cache watches it), at a fixed rate:
//!   what one barrier costs etcd, on the release it runs.
//!
//! They run as goose scenarios with custom requests, so they share the
//! router scenarios' users, throttle and reports.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use goose::prelude::*;
use serde::Serialize;

use crate::api::throttle;
use crate::attack::transaction;
use crate::scrape::{Delta, Snapshot};
use crate::stack::Stack;
use crate::stats::Stats;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Direct,
    Naive,
    Barrier,
}

pub struct EtcdBaseline {
    pub stats: Stats,
    pub kind: Kind,
    clients: Vec<Client>,
    /// `direct`: one long lease per shard, as a router session would be.
    leases: Vec<i64>,
    ttl_secs: i64,
    prefix: String,
    seq: AtomicU64,
    /// `barrier`: the tasks that read each shard's watch of the barrier key.
    watches: Vec<tokio::task::JoinHandle<()>>,
}

const RING_VALUE: &[u8] = br#"{"epoch":1,"ring":"bench"}"#;
const IDENTITY_VALUE: &[u8] = br#"{"shard":"bench","clusterId":"1"}"#;

/// Where the router's lock keys start; its barrier key (`P/locks0`) is in
/// the same watched prefix.
fn locks_key(prefix: &str) -> String {
    format!("{prefix}/locks")
}

/// The router's barrier key (`shard::keys::Keys::barrier`).
fn barrier_key(prefix: &str) -> String {
    format!("{prefix}/locks0")
}

fn ring_key(prefix: &str) -> String {
    format!("{prefix}/ring")
}

fn identity_key(prefix: &str) -> String {
    format!("{prefix}/shard")
}

/// The keys of lock `n`, laid out as the router lays out a name's keys.
struct NameKeys {
    lock: String,
    held: String,
    delay: String,
    waiters: String,
}

impl NameKeys {
    /// The keys of lock `n`: its name's SHA-256 prefix in hex, as the
    /// router names them, not `n` itself. Sequential numbers would sit
    /// next to each other in etcd's key index, where each lookup then
    /// finds its path cached; hashed names are spread over it, and the
    /// baselines must pay for that as the router does.
    fn new(prefix: &str, n: u64) -> Self {
        let keys = lockrouter::keys::Keys::new(prefix);
        let hash = lockrouter::keys::name_hash(&format!("{prefix}:{n}"));
        let text = |key: Vec<u8>| String::from_utf8(key).expect("keys are text");
        Self {
            lock: text(keys.lock(&hash)),
            held: text(keys.held(&hash)),
            delay: text(keys.delay(&hash)),
            waiters: text(keys.waiters(&hash)),
        }
    }
}

impl EtcdBaseline {
    pub async fn connect(
        endpoints: &[String],
        kind: Kind,
        ttl_secs: i64,
        tag: &str,
        stats: Stats,
    ) -> Result<Self> {
        let prefix = format!("/bench/{tag}");
        let mut clients = Vec::new();
        let mut leases = Vec::new();
        let mut watches = Vec::new();
        for ep in endpoints {
            let mut c = Client::connect([ep.as_str()], None)
                .await
                .with_context(|| format!("connect to etcd at {ep}"))?;
            c.put(ring_key(&prefix), RING_VALUE, None).await?;
            c.put(identity_key(&prefix), IDENTITY_VALUE, None).await?;
            if kind == Kind::Direct {
                // Outlives any one attack; revoked in `finish`.
                leases.push(c.lease_grant(3600, None).await?.id());
            }
            if kind == Kind::Barrier {
                // As the router's lock-key cache does: a watch over the
                // lock keys and the barrier key, its events read at once.
                let options = etcd_client::WatchOptions::new().with_prefix();
                let mut events = c.watch(locks_key(&prefix), Some(options)).await?;
                watches.push(tokio::spawn(async move {
                    while let Ok(Some(_)) = events.message().await {}
                }));
            }
            clients.push(c);
        }
        Ok(Self {
            stats,
            kind,
            clients,
            leases,
            ttl_secs,
            prefix,
            seq: AtomicU64::new(0),
            watches,
        })
    }

    /// The next request's number, and the shard it goes to (round robin).
    fn next(&self) -> (u64, usize) {
        let n = self.seq.fetch_add(1, Relaxed);
        (n, (n % self.clients.len() as u64) as usize)
    }

    /// Revokes the shared leases (and so any key left on them), and stops
    /// the watches.
    pub async fn finish(&self) {
        for w in &self.watches {
            w.abort();
        }
        for (c, l) in self.clients.iter().zip(&self.leases) {
            let _ = c.clone().lease_revoke(*l).await;
        }
    }
}

/// The router's grant txn (`shard::name::acquire_txn`), on `lease`: the
/// name has no lock key, held record, lock-delay or queued waiter, and the
/// shard's ring and identity records match; then the lock key on the lease
/// and (`held`) the held record; else the five reads that tell why.
/// Returns the create revision.
async fn acquire_txn(
    c: &mut Client,
    prefix: &str,
    k: &NameKeys,
    lease: i64,
    held: bool,
) -> Result<Option<i64>> {
    let ring = ring_key(prefix);
    let identity = identity_key(prefix);
    let value = format!(r#"{{"client":"bench","epoch":1,"name":"{}"}}"#, k.lock);
    let mut writes = vec![TxnOp::put(
        k.lock.as_str(),
        value,
        Some(PutOptions::new().with_lease(lease)),
    )];
    if held {
        writes.push(TxnOp::put(
            k.held.as_str(),
            r#"{"name":"bench","ttl":30}"#,
            None,
        ));
    }
    let txn = Txn::new()
        .when([
            Compare::create_revision(k.lock.as_str(), CompareOp::Equal, 0),
            Compare::create_revision(k.held.as_str(), CompareOp::Equal, 0),
            Compare::create_revision(k.delay.as_str(), CompareOp::Equal, 0),
            Compare::value(ring.as_str(), CompareOp::Equal, RING_VALUE),
            Compare::value(identity.as_str(), CompareOp::Equal, IDENTITY_VALUE),
            Compare::create_revision(k.waiters.as_str(), CompareOp::Equal, 0).with_prefix(),
        ])
        .and_then(writes)
        .or_else([
            TxnOp::get(k.lock.as_str(), None),
            TxnOp::get(k.held.as_str(), None),
            TxnOp::get(k.delay.as_str(), None),
            TxnOp::get(ring, None),
            TxnOp::get(identity, None),
        ]);
    let resp = c.txn(txn).await?;
    Ok(resp
        .succeeded()
        .then(|| resp.header().map(|h| h.revision()).unwrap_or(0)))
}

/// The router's release txn (`shard::name::release_txn`): delete the lock
/// key and its held record only if the key is still this grant.
async fn release_txn(c: &mut Client, k: &NameKeys, revision: i64, lease: i64) -> Result<bool> {
    let txn = Txn::new()
        .when([
            Compare::create_revision(k.lock.as_str(), CompareOp::Equal, revision),
            Compare::lease(k.lock.as_str(), CompareOp::Equal, lease),
        ])
        .and_then([
            TxnOp::delete(k.lock.as_str(), None),
            TxnOp::delete(k.held.as_str(), None),
        ]);
    Ok(c.txn(txn).await?.succeeded())
}

async fn record(user: &mut GooseUser, name: &str, took: Duration, ok: bool) {
    let _ = user
        .record_custom_request_duration(
            "ETCD",
            name,
            took,
            ok,
            None,
            (!ok).then_some("etcd call failed"),
        )
        .await;
}

pub fn scenario(name: &str, ctx: &Arc<EtcdBaseline>) -> Scenario {
    scenario!(name).register_transaction(transaction("acquire-release", ctx, |user, ctx| {
        Box::pin(async move {
            lifecycle(user, &ctx).await;
            Ok(())
        })
    }))
}

/// One barrier: the identity compared, the barrier key put
/// (`shard::cache::write_barrier`).
async fn barrier(user: &mut GooseUser, ctx: &EtcdBaseline) {
    let (_, shard) = ctx.next();
    let mut c = ctx.clients[shard].clone();
    let stats = &ctx.stats;
    if !throttle(user).await {
        return;
    }
    let flight = stats.sending();
    let started = Instant::now();
    stats.request();
    let txn = Txn::new()
        .when([Compare::value(
            identity_key(&ctx.prefix),
            CompareOp::Equal,
            IDENTITY_VALUE,
        )])
        .and_then([TxnOp::put(barrier_key(&ctx.prefix), Vec::new(), None)]);
    let done = c.txn(txn).await.is_ok_and(|r| r.succeeded());
    let took = started.elapsed();
    drop(flight);
    if done {
        stats.granted(user.weighted_users_index, took);
    } else {
        stats.error();
    }
    record(user, "barrier", took, done).await;
}

async fn lifecycle(user: &mut GooseUser, ctx: &EtcdBaseline) {
    if ctx.kind == Kind::Barrier {
        return barrier(user, ctx).await;
    }
    let (n, shard) = ctx.next();
    let keys = NameKeys::new(&ctx.prefix, n);
    let mut c = ctx.clients[shard].clone();
    let stats = &ctx.stats;

    if !throttle(user).await {
        return;
    }
    let flight = stats.sending();
    let started = Instant::now();
    let acquired: Result<(i64, Option<i64>)> = async {
        let lease = match ctx.kind {
            Kind::Direct => ctx.leases[shard],
            Kind::Barrier => unreachable!("a barrier takes no lease"),
            Kind::Naive => {
                stats.request();
                c.lease_grant(ctx.ttl_secs, None).await?.id()
            }
        };
        stats.request();
        let held = ctx.kind == Kind::Direct;
        Ok((
            lease,
            acquire_txn(&mut c, &ctx.prefix, &keys, lease, held).await?,
        ))
    }
    .await;
    let took = started.elapsed();
    drop(flight);
    let (lease, revision) = match acquired {
        Ok((lease, Some(rev))) => {
            stats.granted(user.weighted_users_index, took);
            record(user, "acquire", took, true).await;
            (lease, rev)
        }
        _ => {
            stats.error();
            record(user, "acquire", took, false).await;
            return;
        }
    };

    // Release even when the throttle has closed: the key must not linger.
    throttle(user).await;
    let flight = stats.sending();
    let started = Instant::now();
    stats.request();
    let released = match ctx.kind {
        Kind::Direct => release_txn(&mut c, &keys, revision, lease)
            .await
            .unwrap_or(false),
        Kind::Naive => c.lease_revoke(lease).await.is_ok(),
        Kind::Barrier => unreachable!("a barrier has no release"),
    };
    drop(flight);
    record(user, "release", started.elapsed(), released).await;
    if released {
        stats.released_one();
    } else {
        stats.error();
    }
}

/// What holding leases the naive way cost etcd.
#[derive(Debug, Clone, Serialize)]
pub struct NaiveHoldOutcome {
    pub leases: u64,
    pub ttl_secs: i64,
    pub ramp_s: f64,
    /// Over the keepalive window.
    pub window: Delta,
    pub keepalives_per_s: f64,
    /// What one keepalive per lock every TTL/3 should come to.
    pub expected_keepalives_per_s: f64,
    pub errors: u64,
}

/// Grants `leases` leases with a lock key each (grant + txn, 64 at a time),
/// keeps every one alive every TTL/3 for `window`, then revokes them all.
/// Keepalives share one stream per shard: what etcd pays per keepalive is
/// the same, and the load generator stays cheap.
pub async fn naive_hold(
    stack: &Stack,
    leases: u64,
    ttl_secs: i64,
    window: Duration,
) -> Result<NaiveHoldOutcome> {
    let base = EtcdBaseline::connect(
        &stack.endpoints(),
        Kind::Naive,
        ttl_secs,
        "naive-hold",
        Stats::new(),
    )
    .await?;
    let base = Arc::new(base);
    let held: Arc<Mutex<Vec<(usize, i64)>>> = Arc::new(Mutex::new(Vec::new()));
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..64)
        .map(|_| {
            let (base, held, next, errors) =
                (base.clone(), held.clone(), next.clone(), errors.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Relaxed);
                    if n >= leases {
                        return;
                    }
                    let shard = (n % base.clients.len() as u64) as usize;
                    let mut c = base.clients[shard].clone();
                    let keys = NameKeys::new(&base.prefix, n);
                    let got = async {
                        let lease = c.lease_grant(base.ttl_secs, None).await?.id();
                        acquire_txn(&mut c, &base.prefix, &keys, lease, false).await?;
                        anyhow::Ok(lease)
                    }
                    .await;
                    match got {
                        Ok(lease) => held.lock().expect("held").push((shard, lease)),
                        Err(_) => {
                            errors.fetch_add(1, Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await?;
    }
    let ramp_s = started.elapsed().as_secs_f64();
    let all = std::mem::take(&mut *held.lock().expect("held"));

    // One keepalive per lease every TTL/3, spread evenly over the period.
    let period = Duration::from_millis(ttl_secs as u64 * 1000 / 3);
    let mut keepers = Vec::new();
    let mut readers = Vec::new();
    for (i, c) in base.clients.iter().enumerate() {
        let Some(&(_, first)) = all.iter().find(|(s, _)| *s == i) else {
            keepers.push(None);
            continue;
        };
        let (keeper, mut stream) = c.clone().lease_keep_alive(first).await?;
        readers.push(tokio::spawn(async move {
            while let Ok(Some(_)) = stream.message().await {}
        }));
        keepers.push(Some(keeper));
    }
    let s0 = Snapshot::take(stack)?;
    let deadline = Instant::now() + window;
    let slices = 50u32;
    'rounds: while Instant::now() < deadline {
        let round = Instant::now();
        for (k, chunk) in all
            .chunks(all.len().div_ceil(slices as usize).max(1))
            .enumerate()
        {
            for &(shard, lease) in chunk {
                if let Some(keeper) = keepers[shard].as_mut() {
                    keeper.id = lease;
                    if keeper.keep_alive().await.is_err() {
                        errors.fetch_add(1, Relaxed);
                    }
                }
            }
            tokio::time::sleep_until((round + period * (k as u32 + 1) / slices).into()).await;
            if Instant::now() >= deadline {
                break 'rounds;
            }
        }
    }
    let s1 = Snapshot::take(stack)?;
    for r in readers {
        r.abort();
    }
    let revokers: Vec<_> = all
        .chunks(all.len().div_ceil(64).max(1))
        .map(|chunk| {
            let (base, chunk) = (base.clone(), chunk.to_vec());
            tokio::spawn(async move {
                for (shard, lease) in chunk {
                    let _ = base.clients[shard].clone().lease_revoke(lease).await;
                }
            })
        })
        .collect();
    for r in revokers {
        r.await?;
    }
    let delta = s1.since(&s0);
    Ok(NaiveHoldOutcome {
        leases: all.len() as u64,
        ttl_secs,
        ramp_s,
        keepalives_per_s: delta.etcd.lease_renewals / delta.seconds.max(1e-9),
        expected_keepalives_per_s: all.len() as f64 / period.as_secs_f64(),
        window: delta,
        errors: errors.load(Relaxed) as u64,
    })
}
