//! Migrations: the protocol that changes the shard set, and epoch bumps,
//! in one place (`docs/design.md`, section 12).
//!
//! - [`open`] a migration on reload (or [`already_moved`]: another replica
//!   opened it), [`bump_epoch`] on an operator's request: both reserve their
//!   epoch on every shard, then write the ring records, old shards first.
//! - [`follow`] an open migration the shards record (the monitor attaches
//!   it to the router before it may grant), [`maybe_close`] it once no
//!   moved name is left on its previous shards, and [`finish_close`] one
//!   another replica closed on some shards.
//!
//! Everything here writes only with compare-and-swap on what it read, so
//! every intermediate state is safe; section 12 of the design doc argues
//! each step.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::config::{Settings, ShardSettings};
use crate::metrics as m;
use crate::placement::ring::Ring;
use crate::placement::topology::{log_ring_change, ConnectError, Migration, Router};
use crate::shard::conn::EtcdError;
use crate::shard::keys::{Identity, PreviousRing, Recorded, Reservation, RingMeta};
use crate::shard::{classify, IdentityGuard, Probe, RingGuard, RingState, Shard};
use crate::token::fencing::MAX_EPOCH;

/// Why a migration or a bump cannot happen now (nothing unsafe was
/// written; a later try may succeed). The errors of connections and of
/// etcd are kept as their sources.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// A shard of the new config could not be connected to.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A shard did not answer a read the change needs; `needs` says which
    /// ("" when the error says it all).
    #[error("{needs}{source}")]
    Unreachable {
        needs: &'static str,
        #[source]
        source: EtcdError,
    },
    /// What the shards record does not allow it now; the message says
    /// what, and what to do.
    #[error("{0}")]
    Records(String),
    /// A migration's epoch change was written on some shards only: safe
    /// as it stands (a fenced shard refuses the old ring, and the new one
    /// is not served until every shard records it), and retried.
    #[error(
        "the migration to ring {to} is only partly open ({source}); the reload is retried at the next poll, \
         or send SIGHUP / POST /admin/v1/reload"
    )]
    PartlyOpen {
        to: String,
        #[source]
        source: EpochNotChanged,
    },
    /// A bump's epoch change was written on some shards only.
    #[error(transparent)]
    NotBumped(EpochNotChanged),
}

/// Why an epoch change stopped at a shard (the shards before it may have
/// reserved the epoch or recorded the new meta).
#[derive(Debug, thiserror::Error)]
pub enum EpochNotChanged {
    #[error("shard {shard} changed since it was read (another bump or migration?); epoch {epoch} is skipped, retry")]
    Changed { shard: String, epoch: u64 },
    #[error("{shard} now records {now:?}")]
    RecordsOther {
        shard: String,
        now: Option<Box<RingMeta>>,
    },
    #[error("{shard}: {source}")]
    Unreachable {
        shard: String,
        #[source]
        source: EtcdError,
    },
}

impl Refused {
    fn unreachable(needs: &'static str) -> impl FnOnce(EtcdError) -> Self {
        move |source| Self::Unreachable { needs, source }
    }
}

/// The meta that opens a migration from `from`'s ring to `to` at `epoch`.
pub fn opening_meta(epoch: u64, from: &Router, to: &Ring) -> RingMeta {
    RingMeta {
        epoch,
        ring: to.fingerprint().to_string(),
        previous: Some(PreviousRing {
            ring: from.ring.fingerprint().to_string(),
            vnodes: from.vnodes,
            shards: from
                .shard_settings
                .iter()
                .map(ShardSettings::recordable)
                .collect(),
        }),
    }
}

/// Attaches the open migration `open` to the router; false if it cannot.
pub async fn follow(router: &Router, open: &Recorded) -> bool {
    let Some(prev) = open.meta.previous.as_ref() else {
        return false;
    };
    let current = router.migration();
    let migration = match current {
        Some(m)
            if m.recorded.meta.epoch == open.meta.epoch
                && m.recorded.meta.previous == open.meta.previous =>
        {
            m
        }
        _ => {
            // The previous ring is data read from etcd: validated, never
            // trusted to build.
            let ring = match Ring::try_new(&prev.shards, prev.vnodes) {
                Ok(ring) if ring.fingerprint() == prev.ring => ring,
                Ok(ring) => {
                    tracing::error!(recorded = %prev.ring, rebuilt = %ring.fingerprint(), "cannot rebuild the previous ring of the open migration");
                    return false;
                }
                Err(e) => {
                    tracing::error!(recorded = %prev.ring, error = %e, "the open migration records an invalid previous ring");
                    return false;
                }
            };
            let mut shards = Vec::new();
            for s in &prev.shards {
                match router.pool.get_recorded(s).await {
                    Ok(shard) => shards.push(shard),
                    Err(e) => {
                        tracing::error!(shard = %s.name, error = %e, "cannot connect a shard of the previous ring");
                        return false;
                    }
                }
            }
            tracing::info!(from = %prev.ring, to = %open.meta.ring, epoch = open.meta.epoch, "following an open migration");
            let m = Arc::new(Migration {
                recorded: open.clone(),
                ring,
                shards,
                moved_held: Mutex::new(BTreeMap::new()),
            });
            router.set_migration(Some(m.clone()));
            m
        }
    };
    // Draining shards are probed here, which keeps their up flag current
    // and verifies their identity (the endpoints recorded for them are
    // input, and may reach the wrong cluster). Nothing is written: a fence
    // left incomplete is completed by the opener's retry or by an epoch
    // bump, never guessed at here (a shard that records nothing may have
    // lost its data).
    let fp = router.ring.fingerprint();
    for shard in migration
        .shards
        .iter()
        .filter(|s| !router.shards.iter().any(|c| c.name() == s.name()))
    {
        if let Ok(probe) = shard.probe().await {
            let state = shard.verify(&probe, fp).await;
            log_ring_change(shard, &shard.ring_state(), &state, fp);
            shard.set_ring_state(state);
        }
    }
    true
}

/// Counts moved names still on their previous shards; closes the
/// migration when there are none and every previous shard is fenced.
pub async fn maybe_close(router: &Router, migration: &Migration) {
    let mut total = 0;
    let mut held = BTreeMap::new();
    for shard in &migration.shards {
        let fenced = matches!(shard.read_ring().await, Ok(Some(r)) if r.meta.ring == router.ring.fingerprint());
        match (fenced, moved_names_left(router, shard).await) {
            (true, Ok(n)) => {
                m::migration_moved_held(shard.name(), n);
                held.insert(shard.name().to_string(), n);
                total += n;
            }
            _ => return, // unknown: keep the migration open
        }
    }
    *migration.moved_held.lock().expect("moved lock") = held;
    if total > 0 {
        return;
    }
    let closed = Recorded::new(RingMeta {
        previous: None,
        ..migration.recorded.meta.clone()
    });
    let mut everywhere = true;
    for shard in router.all_shards() {
        let Some(guard) = verified_guard(&shard) else {
            everywhere = false;
            continue;
        };
        match shard
            .swap_ring(Some(&migration.recorded.bytes), &closed, &guard)
            .await
        {
            Ok(Some(r)) if r == closed => {}
            _ => everywhere = false,
        }
    }
    if everywhere {
        tracing::info!(ring = %closed.meta.ring, epoch = closed.meta.epoch, "migration closed: no moved name is held on its previous shard");
        for shard in &migration.shards {
            m::migration_moved_held(shard.name(), 0);
        }
        // The shards' known records first: detaching the migration while they
        // still showed the open one would refuse grants until the next round.
        for shard in &router.shards {
            shard.set_ring_state(RingState::Ready(closed.clone()));
        }
        router.set_migration(None);
    }
}

/// Moved names still present on their previous shard `shard`: held, lost
/// without a lock-delay set yet, or waiting out one. Any of them keeps the
/// migration open (the new shard checks there before granting).
async fn moved_names_left(
    router: &Router,
    shard: &Shard,
) -> Result<i64, crate::shard::conn::EtcdError> {
    let here = shard.name();
    let moved = |name: &str| router.ring.shard_name(name) != here;
    shard.names_left(moved, router.lock_delay).await
}

/// A ring replacement guarded by the identity verified on `shard`.
fn verified_guard(shard: &Shard) -> Option<RingGuard> {
    Some(RingGuard {
        reservation: None,
        identity: IdentityGuard::Verified(shard.verified_identity()?),
    })
}

/// A migration was closed on some shards (then it is over everywhere: the
/// closer saw no moved lock left); record the closed meta on the rest.
pub async fn finish_close(router: &Router, closed: &Recorded, states: &mut [Option<RingState>]) {
    for (shard, state) in router.shards.iter().zip(states.iter_mut()) {
        if let Some(RingState::Ready(r)) = state {
            if r.meta.epoch == closed.meta.epoch && r.meta.previous.is_some() {
                let Some(guard) = verified_guard(shard) else {
                    continue;
                };
                if let Ok(found) = shard.swap_ring(Some(&r.bytes), closed, &guard).await {
                    *state = Some(classify(found, &closed.meta.ring));
                }
            }
        }
    }
}

/// Whether every shard of the new ring already records it (another
/// replica opened this migration, maybe closed it too).
pub async fn already_moved(old: &Router, new: &Settings, ring: &Ring) -> Result<bool, Refused> {
    // A removed shard must be fenced too, or the opening is resumed; one
    // that no longer answers (retired after the migration) is skipped.
    for shard in old
        .shards
        .iter()
        .filter(|o| !new.shards.iter().any(|s| s.name == o.name()))
    {
        if let Ok(recorded) = shard.read_ring().await {
            if recorded.is_none_or(|r| r.meta.ring != ring.fingerprint()) {
                return Ok(false);
            }
        }
    }
    for s in &new.shards {
        let shard = old.pool.get(s).await?;
        let recorded = shard.read_ring().await.map_err(Refused::unreachable(""))?;
        if recorded.is_none_or(|r| r.meta.ring != ring.fingerprint()) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Opens the migration from `old`'s ring to `ring` (or opens it anew
/// over an opening left incomplete, by this or another replica): every
/// shard, old and joining, must end up recording the opening meta (new
/// ring, an epoch above every epoch any shard records or has reserved,
/// previous ring). The epoch is reserved on every shard first; then old
/// shards are fenced, so routers on the old ring stop granting before
/// anything grants under the new, and joining shards last, each with its
/// identity.
pub async fn open(old: &Router, new: &Settings, ring: &Ring) -> Result<(), Refused> {
    let (from, to) = (old.ring.fingerprint(), ring.fingerprint());
    if !old.is_confirmed() {
        return refuse(
            "this router does not serve its ring yet; a migration starts from a serving ring"
                .into(),
        );
    }
    let is_opening = |r: &Recorded| {
        r.meta.ring == to && r.meta.previous.as_ref().is_some_and(|p| p.ring == from)
    };
    let mut shards: Vec<(Arc<Shard>, bool)> =
        old.shards.iter().map(|s| (s.clone(), false)).collect();
    for s in new
        .shards
        .iter()
        .filter(|s| !old.shards.iter().any(|o| o.name() == s.name))
    {
        shards.push((old.pool.get(s).await?, true));
    }
    let mut base = None::<u64>;
    let mut steps = Vec::new();
    for (shard, joining) in &shards {
        let probe = shard.probe().await.map_err(Refused::unreachable(
            "a migration needs every shard reachable: ",
        ))?;
        match (&probe.ring, joining) {
            (Some(r), _) if is_opening(r) => {}
            (Some(r), false) if r.meta.ring == from && r.meta.previous.is_none() => {
                if base.is_some_and(|b| b != r.meta.epoch) {
                    return refuse(format!(
                        "shard {} records another epoch than its peers",
                        shard.name()
                    ));
                }
                base = Some(r.meta.epoch);
            }
            (None, true) if probe.identity.is_none() && probe.reservation.is_none() => {}
            (other, _) => {
                let what = other
                    .as_ref()
                    .map(|r| format!("ring {} epoch {}", r.meta.ring, r.meta.epoch));
                let role = if *joining {
                    "joining shard (must be empty)"
                } else {
                    "shard"
                };
                return refuse(format!(
                    "{role} {} records {what:?}, which a migration from {from} cannot start from",
                    shard.name()
                ));
            }
        }
        let identity = opening_identity(shard, &probe, *joining)?;
        steps.push(Step {
            shard: shard.clone(),
            probe,
            identity,
        });
    }
    let top = steps.iter().map(|s| s.probe.top_epoch()).max().unwrap_or(0);
    if top >= MAX_EPOCH {
        return refuse(format!("the ring epoch is at its maximum ({MAX_EPOCH})"));
    }
    let opening = Recorded::new(opening_meta(top + 1, old, ring));
    change_epoch(&steps, &opening)
        .await
        .map_err(|source| Refused::PartlyOpen {
            to: to.to_string(),
            source,
        })?;
    tracing::info!(from = %from, to = %to, epoch = opening.meta.epoch, "migration open on every shard");
    Ok(())
}

/// Records the next epoch, same ring, on every shard: for a shard
/// restored from a snapshot or one that lost its data (its revisions
/// went back; it may record no ring at all). Every grant from then on
/// carries a token above every earlier one: the next epoch is above
/// every epoch any shard records or has reserved, and is reserved on
/// every shard before any records it. Needs every shard reachable and
/// no migration it cannot see; a partial bump is safe and may be
/// repeated. A shard that records nothing at all (no identity either)
/// is initialised only if `req` names it: it may have lost its data, or
/// this router's endpoints for it may reach the wrong cluster.
pub async fn bump_epoch(router: &Router, req: &BumpRequest) -> Result<u64, Refused> {
    let fp = router.ring.fingerprint();
    // During a migration the bump keeps it open (same previous ring) and
    // also completes its fence on shards that missed it.
    let migration = router.migration();
    let previous = migration
        .as_ref()
        .and_then(|m| m.recorded.meta.previous.clone());
    let mut shards = router.shards.clone();
    if let Some(m) = &migration {
        shards.extend(
            m.shards
                .iter()
                .filter(|s| !router.shards.iter().any(|c| c.name() == s.name()))
                .cloned(),
        );
    }
    for name in &req.reinitialize {
        if !shards.iter().any(|s| s.name() == name) {
            return refuse(format!(
                "reinitialize names {name:?}, which is not a shard of this router"
            ));
        }
    }
    let mut steps = Vec::new();
    for shard in &shards {
        let probe = (shard.probe().await).map_err(Refused::unreachable(
            "bumping the epoch needs every shard reachable: ",
        ))?;
        match &probe.ring {
            // A migration this router has not attached: bumping would
            // drop its `previous` and close it without the closing scan.
            Some(r) if r.meta.ring == fp && !router.follows(r) => {
                return refuse(format!(
                    "shard {} records a migration this router has not attached yet; retry in a moment",
                    shard.name()
                ))
            }
            Some(r) if r.meta.ring != fp && previous.as_ref().is_none_or(|p| p.ring != r.meta.ring) => {
                return refuse(format!(
                    "shard {} records ring {} (epoch {}), neither this router's ring nor the one it migrates from",
                    shard.name(), r.meta.ring, r.meta.epoch
                ))
            }
            _ => {}
        }
        let identity = bump_identity(shard, &probe, req)?;
        steps.push(Step {
            shard: shard.clone(),
            probe,
            identity,
        });
    }
    let top = steps.iter().map(|s| s.probe.top_epoch()).max().unwrap_or(0);
    if top == 0 && req.min_epoch.is_none() {
        return refuse(
            "no shard records a ring yet; a fresh deployment is initialised by itself".into(),
        );
    }
    let next = top.max(req.min_epoch.unwrap_or(0).saturating_sub(1)) + 1;
    if next > MAX_EPOCH {
        return refuse(format!(
            "the ring epoch would pass its maximum ({MAX_EPOCH})"
        ));
    }
    let new = Recorded::new(RingMeta {
        epoch: next,
        ring: fp.to_string(),
        previous,
    });
    change_epoch(&steps, &new)
        .await
        .map_err(Refused::NotBumped)?;
    for step in &steps {
        step.shard
            .set_verified_identity(Some(step.identity.new_bytes()));
        step.shard.set_ring_state(RingState::Ready(new.clone()));
    }
    tracing::info!(epoch = next, ring = %fp, "ring epoch bumped on every shard");
    Ok(next)
}

/// What `POST /admin/v1/bump-epoch` may carry.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BumpRequest {
    /// Shards that record nothing (lost their data) to initialise.
    #[serde(default)]
    pub reinitialize: Vec<String>,
    /// The lowest epoch to record: for when every shard lost its data, so
    /// none remembers the epochs used (take it from the highest fencing
    /// token your resources saw: `token >> 47`, plus one).
    #[serde(default)]
    pub min_epoch: Option<u64>,
}

fn refuse<T>(msg: String) -> Result<T, Refused> {
    Err(Refused::Records(msg))
}

/// One shard's part in an epoch change: what it recorded when read, and
/// how its identity is checked or written.
struct Step {
    shard: Arc<Shard>,
    probe: Probe,
    identity: IdentityGuard,
}

/// Reserves `new`'s epoch on every shard of `steps` (a compare-and-swap on
/// what each recorded when read), then records `new` on each in order, each
/// write guarded by that reservation: a later reservation by any other
/// writer stops this one. Stops at the first failure, naming it.
async fn change_epoch(steps: &[Step], new: &Recorded) -> Result<(), EpochNotChanged> {
    let reservation = Reservation::fresh(new.meta.epoch);
    for step in steps {
        let seen = step.probe.reservation.as_ref().map(|(_, b)| b.as_slice());
        match step.shard.reserve_epoch(seen, &reservation).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(EpochNotChanged::Changed {
                    shard: step.shard.name().to_string(),
                    epoch: new.meta.epoch,
                })
            }
            Err(source) => {
                return Err(EpochNotChanged::Unreachable {
                    shard: step.shard.name().to_string(),
                    source,
                })
            }
        }
    }
    for step in steps {
        let guard = RingGuard {
            reservation: Some(reservation.to_bytes()),
            identity: match &step.identity {
                IdentityGuard::Verified(b) => IdentityGuard::Verified(b.clone()),
                IdentityGuard::Create(b) => IdentityGuard::Create(b.clone()),
                IdentityGuard::Replace(a, b) => IdentityGuard::Replace(a.clone(), b.clone()),
            },
        };
        let expected = step.probe.ring.as_ref().map(|r| r.bytes.as_slice());
        match step.shard.swap_ring(expected, new, &guard).await {
            Ok(Some(r)) if r == *new => {}
            Ok(other) => {
                return Err(EpochNotChanged::RecordsOther {
                    shard: step.shard.name().to_string(),
                    now: other.map(|r| Box::new(r.meta)),
                })
            }
            Err(source) => {
                return Err(EpochNotChanged::Unreachable {
                    shard: step.shard.name().to_string(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// How a bump treats a shard's identity: kept if it names this shard (the
/// cluster id is brought up to date: a restored shard answers from another
/// cluster), created only for a shard that records nothing and that the
/// request names.
fn bump_identity(
    shard: &Shard,
    probe: &Probe,
    req: &BumpRequest,
) -> Result<IdentityGuard, Refused> {
    let current = Identity::new(shard.name(), probe.cluster_id);
    match &probe.identity {
        Some(Ok((id, bytes))) if id.shard == shard.name() => Ok(if *id == current {
            IdentityGuard::Verified(bytes.clone())
        } else {
            IdentityGuard::Replace(bytes.clone(), current.to_bytes())
        }),
        Some(Ok((id, _))) => refuse(format!(
            "the cluster at shard {}'s endpoints is shard {:?}: fix this router's config",
            shard.name(),
            id.shard
        )),
        Some(Err(_)) => refuse(format!(
            "shard {} records an unreadable identity",
            shard.name()
        )),
        None if probe.ring.is_some() => refuse(format!(
            "shard {} records no identity yet; retry in a moment",
            shard.name()
        )),
        None if req.reinitialize.iter().any(|n| n == shard.name()) => {
            Ok(IdentityGuard::Create(current.to_bytes()))
        }
        None => refuse(format!(
            "shard {} records nothing: if it lost its data, bump with {{\"reinitialize\": [{:?}]}} \
             after checking that this router's endpoints for it are right",
            shard.name(), shard.name()
        )),
    }
}

/// How a migration's opening treats a shard's identity: an old shard must
/// carry the identity this router verified; a joining shard gets one.
fn opening_identity(shard: &Shard, probe: &Probe, joining: bool) -> Result<IdentityGuard, Refused> {
    let current = Identity::new(shard.name(), probe.cluster_id);
    match &probe.identity {
        Some(Ok((id, bytes))) if *id == current => Ok(IdentityGuard::Verified(bytes.clone())),
        None if joining => Ok(IdentityGuard::Create(current.to_bytes())),
        _ => refuse(format!(
            "shard {}'s identity is not verified (see the router log); a migration needs every shard's",
            shard.name()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal reads as it always did, and keeps what stopped it as its
    /// source for a caller that wants the kind, not the text.
    #[test]
    fn a_partly_open_migration_names_the_shard_that_stopped_it() {
        let stopped = EpochNotChanged::Changed {
            shard: "b".into(),
            epoch: 7,
        };
        let refused = Refused::PartlyOpen {
            to: "ring-2".into(),
            source: stopped,
        };
        let text = refused.to_string();
        assert!(
            text.starts_with("the migration to ring ring-2 is only partly open (shard b changed since it was read"),
            "{text}"
        );
        assert!(text.contains("epoch 7 is skipped"), "{text}");
        let source = std::error::Error::source(&refused).expect("a source");
        assert!(matches!(
            source.downcast_ref::<EpochNotChanged>(),
            Some(EpochNotChanged::Changed { epoch: 7, .. })
        ));
        let unreachable = Refused::unreachable("a migration needs every shard reachable: ")(
            EtcdError::Unavailable {
                shard: "c".into(),
                detail: "no leader".into(),
            },
        );
        assert!(
            unreachable
                .to_string()
                .starts_with("a migration needs every shard reachable: "),
            "{unreachable}"
        );
        assert!(std::error::Error::source(&unreachable).is_some());
    }
}
