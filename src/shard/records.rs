//! The shard's own records: the ring (`P/ring`), its identity (`P/shard`)
//! and the epoch reservation (`P/epoch`): reading them (the monitor's
//! probe), writing them (initialisation, adoption of an identity, epoch
//! reservations, ring replacements), and checking that the cluster that
//! answers is this shard (see `docs/design.md`, sections 3 and 8).

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::conn::EtcdError;
use super::keys::{Identity, Recorded, Reservation};
use super::name::gets;
use super::{classify, IdentityGuard, IdentityProblem, Probe, RingGuard, RingState, Shard};

impl Shard {
    /// Reads the shard-level keys (also the health probe).
    pub async fn probe(&self) -> Result<Probe, EtcdError> {
        let k = &self.keys;
        let resp = self
            .conn
            .txn_hedged(Txn::new().and_then([
                TxnOp::get(k.ring(), None),
                TxnOp::get(k.identity(), None),
                TxnOp::get(k.epoch(), None),
            ]))
            .await
            .inspect_err(|e| {
                // Hedged: no member answered it. (A call's own failure
                // marks a shard of one member down already.)
                if let EtcdError::Unavailable { detail, .. } = e {
                    self.conn.set_down(detail);
                }
            })?;
        let cluster_id = resp.header().map_or(0, |h| h.cluster_id());
        let mut gets = gets(resp);
        let ring = gets.next().flatten().map(|kv| Recorded::parse(kv.value()));
        let identity = gets.next().flatten().map(|kv| {
            let bytes = kv.value().to_vec();
            serde_json::from_slice::<Identity>(&bytes)
                .map(|id| (id, bytes.clone()))
                .map_err(|_| bytes)
        });
        let reservation = gets.next().flatten().map(|kv| {
            let bytes = kv.value().to_vec();
            // An unreadable reservation counts as the highest epoch there is,
            // so nothing ever reuses an epoch because of it.
            let r = serde_json::from_slice(&bytes).unwrap_or(Reservation {
                epoch: u64::MAX,
                by: String::new(),
            });
            (r, bytes)
        });
        Ok(Probe {
            ring,
            identity,
            reservation,
            cluster_id,
        })
    }

    /// Reads the recorded ring.
    pub async fn read_ring(&self) -> Result<Option<Recorded>, EtcdError> {
        Ok(self.probe().await?.ring)
    }

    /// Initialises a shard that has never been used (no ring, identity or
    /// reservation): records `ring`, `identity` and `reservation` at once.
    /// Returns whether this call did (a record found equal to `ring` may
    /// have come with another replica's identity for this cluster).
    pub async fn initialise(
        &self,
        ring: &Recorded,
        identity: &Identity,
        reservation: &Reservation,
    ) -> Result<bool, EtcdError> {
        let k = &self.keys;
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.ring(), CompareOp::Equal, 0),
                Compare::create_revision(k.identity(), CompareOp::Equal, 0),
                Compare::create_revision(k.epoch(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(k.ring(), ring.bytes.clone(), None),
                TxnOp::put(k.identity(), identity.to_bytes(), None),
                TxnOp::put(k.epoch(), reservation.to_bytes(), None),
            ]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Records `identity` on a shard initialised before shards had one,
    /// only while it records none and still records the ring `ring`.
    pub async fn adopt_identity(
        &self,
        identity: &Identity,
        ring: &[u8],
    ) -> Result<bool, EtcdError> {
        let k = &self.keys;
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.identity(), CompareOp::Equal, 0),
                Compare::value(k.ring(), CompareOp::Equal, ring.to_vec()),
            ])
            .and_then([TxnOp::put(k.identity(), identity.to_bytes(), None)]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Reserves `new` if `P/epoch` still holds `seen` (`None`: nothing).
    pub async fn reserve_epoch(
        &self,
        seen: Option<&[u8]>,
        new: &Reservation,
    ) -> Result<bool, EtcdError> {
        let key = self.keys.epoch();
        let guard = match seen {
            None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            Some(bytes) => Compare::value(key.clone(), CompareOp::Equal, bytes.to_vec()),
        };
        let txn = Txn::new()
            .when([guard])
            .and_then([TxnOp::put(key, new.to_bytes(), None)]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Replaces the recorded ring with `new` if it is still `expected`
    /// (`None`: no ring recorded) and `guard` holds. Returns what the shard
    /// records after.
    pub async fn swap_ring(
        &self,
        expected: Option<&[u8]>,
        new: &Recorded,
        guard: &RingGuard,
    ) -> Result<Option<Recorded>, EtcdError> {
        let k = &self.keys;
        let mut when = vec![match expected {
            None => Compare::create_revision(k.ring(), CompareOp::Equal, 0),
            Some(bytes) => Compare::value(k.ring(), CompareOp::Equal, bytes.to_vec()),
        }];
        let mut then = vec![TxnOp::put(k.ring(), new.bytes.clone(), None)];
        if let Some(bytes) = &guard.reservation {
            when.push(Compare::value(k.epoch(), CompareOp::Equal, bytes.clone()));
        }
        match &guard.identity {
            IdentityGuard::Verified(bytes) => when.push(Compare::value(
                k.identity(),
                CompareOp::Equal,
                bytes.clone(),
            )),
            IdentityGuard::Create(bytes) => {
                when.push(Compare::create_revision(k.identity(), CompareOp::Equal, 0));
                then.push(TxnOp::put(k.identity(), bytes.clone(), None));
            }
            IdentityGuard::Replace(old, new) => {
                when.push(Compare::value(k.identity(), CompareOp::Equal, old.clone()));
                then.push(TxnOp::put(k.identity(), new.clone(), None));
            }
        }
        let txn = Txn::new()
            .when(when)
            .and_then(then)
            .or_else([TxnOp::get(k.ring(), None)]);
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(Some(new.clone()));
        }
        Ok(gets(resp)
            .next()
            .flatten()
            .map(|kv| Recorded::parse(kv.value())))
    }

    /// Checks that `probe` comes from the cluster that is `shard` and says
    /// what the shard records; sets (or clears) the shard's verified identity.
    pub async fn verify(&self, probe: &Probe, fp: &str) -> RingState {
        let shard = self;
        let answering = format!("{:016x}", probe.cluster_id);
        let (state, verified) = match &probe.identity {
            Some(Ok((id, bytes))) if id.shard == shard.name && id.cluster_id == answering => {
                (classify(probe.ring.clone(), fp), Some(bytes.clone()))
            }
            Some(Ok((id, _))) if id.shard != shard.name => (
                RingState::Identity(IdentityProblem::OtherShard(format!(
                    "the etcd cluster at these endpoints is shard {:?}",
                    id.shard
                ))),
                None,
            ),
            Some(Ok((id, _))) => (
                RingState::Identity(IdentityProblem::OtherCluster(format!(
                    "the shard was recorded in etcd cluster {} but cluster {answering} answers: \
                     restored from a snapshot or copied to another cluster? Its revisions may have \
                     gone back; bump the epoch (docs/operations.md)",
                    id.cluster_id
                ))),
                None,
            ),
            Some(Err(bytes)) => (
                RingState::Identity(IdentityProblem::OtherShard(format!(
                    "unreadable identity record {:?}",
                    String::from_utf8_lossy(bytes)
                ))),
                None,
            ),
            None => return shard.adopt(probe, fp).await,
        };
        shard.set_verified_identity(verified);
        state
    }

    /// A shard that records no identity: never initialised (it records nothing
    /// at all), or initialised before shards had one. The latter gets this
    /// shard's identity recorded, but only while it records this router's very
    /// ring: a cluster holding the deployment's ring is one of its shards.
    async fn adopt(&self, probe: &Probe, fp: &str) -> RingState {
        let shard = self;
        shard.set_verified_identity(None);
        let Some(ring) = probe.ring.as_ref().filter(|r| r.meta.ring == fp) else {
            return classify(probe.ring.clone(), fp);
        };
        let identity = Identity::new(&shard.name, probe.cluster_id);
        match shard.adopt_identity(&identity, &ring.bytes).await {
            Ok(true) => {
                tracing::info!(shard = %shard.name, cluster = %identity.cluster_id, "recorded the shard's identity");
                shard.set_verified_identity(Some(identity.to_bytes()));
                RingState::Ready(ring.clone())
            }
            _ => RingState::Unknown, // looked at again next round
        }
    }
}
