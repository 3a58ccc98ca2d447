//! The leases the lock layer holds on a shard, as it asks for them: each
//! client's session lease (got from the session cache of [`sessions`], or
//! granted once a quota's hook allows it; kept alive; forgotten once
//! found gone), the grant of any lease (sessions, spares, queue entries,
//! lock-delays: [`sessions::grant_lease`]), and the keepalive of any
//! lease, through the coalescing stream of [`keepalive`].
//!
//! A session's grant counts as its first keepalive, so an acquire right
//! after it sends none. A session is forgotten only when etcd says its
//! lease is gone: the next acquire of its client then grants another.
//!
//! [`sessions`]: super::sessions
//! [`sessions::grant_lease`]: super::sessions::grant_lease
//! [`keepalive`]: super::keepalive

use std::time::Duration;

use super::conn::EtcdError;
use super::keepalive::Renewal;
use super::sessions::{grant_lease, SessionLease, SessionUse};
use super::Shard;
use crate::token::lease_tag::LeaseTag;

impl Shard {
    /// The session lease of `holder` for locks of `ttl_secs` on this shard,
    /// which its acquires here share. Without one, a new lease is granted
    /// (its id carrying `tag`) once `admit` allows it: a quota's hook, whose
    /// refusal is the answer, with nothing granted. Concurrent first
    /// acquires of one holder share one grant. A session past the end its
    /// last confirmed keepalive (or grant) gave it is replaced at once: a
    /// session only acquires kept alive, and none came in time. A new one
    /// costs a grant; asking etcd of the old one would wait, if it has
    /// expired, until etcd revokes it.
    ///
    /// `usage`: how keys go on it. An acquire's grant txn is counted when
    /// it is sent ([`Shard::grant_on_session`]); anything else (a waiter's
    /// entry, an extend's move) pins the session, whose lease is then
    /// never handed on to another client ([`recycle`](super::recycle)).
    pub async fn session<E: From<EtcdError>>(
        &self,
        holder: &str,
        ttl_secs: u32,
        tag: Option<LeaseTag>,
        usage: SessionUse,
        admit: impl Fn() -> Result<(), E>,
    ) -> Result<SessionLease, E> {
        let grant = || async {
            admit()?;
            Ok::<_, E>(self.grant_session(ttl_secs, tag).await?)
        };
        // A lease handed on between the lookup and the pin is not the
        // session's any more: the next lookup grants another, which cannot
        // be handed on so soon (its last acquire is now), so the second
        // try pins.
        for _ in 0..2 {
            let mut session = (self.sessions)
                .get_or_grant(holder, ttl_secs, tag, grant)
                .await?;
            if !self.keepalive.lasts(session.id, Duration::ZERO) {
                self.forget_session(holder, &session).await;
                session = (self.sessions)
                    .get_or_grant(holder, ttl_secs, tag, grant)
                    .await?;
            }
            let pinned = || self.sessions.pin(holder, ttl_secs, session.id);
            if usage == SessionUse::Acquire || pinned() {
                return Ok(session);
            }
        }
        Err(E::from(EtcdError::Unavailable {
            shard: self.name.clone(),
            detail: "the client's session changed hands twice; retry".into(),
        }))
    }

    /// Grants a lease; returns its id and the TTL etcd granted (which may
    /// be above the one asked for: etcd raises TTLs to its minimum).
    pub(super) async fn grant(&self, ttl_secs: u32) -> Result<(i64, i64), EtcdError> {
        let (id, granted) = grant_lease(&self.conn, ttl_secs, None).await?;
        Ok((id, granted.ttl_secs))
    }

    /// A new session lease: a fresh spare if one is ready (granted ahead
    /// of need, [`spares`](super::spares)), else one granted now. Its grant
    /// counts as its first keepalive.
    async fn grant_session(
        &self,
        ttl_secs: u32,
        tag: Option<LeaseTag>,
    ) -> Result<SessionLease, EtcdError> {
        let (id, renewal) = match self.spares.take(ttl_secs, tag) {
            Some(spare) => (spare.id, spare.granted),
            None => grant_lease(&self.conn, ttl_secs, tag).await?,
        };
        crate::metrics::session_granted(&self.name);
        self.keepalive.seed(id, renewal);
        Ok(SessionLease { id, ttl_secs })
    }

    /// Forgets `holder`'s `session`, found gone, so that its next acquire
    /// gets a new one.
    pub async fn forget_session(&self, holder: &str, session: &SessionLease) {
        (self.sessions)
            .invalidate(holder, session.ttl_secs, session.id)
            .await;
    }

    /// Keeps `holder`'s `session` alive ([`Shard::renew_lease`]); `None`
    /// if its lease is gone, and then the session is forgotten
    /// ([`Shard::session_gone`]).
    pub async fn keep_session(
        &self,
        holder: &str,
        session: &SessionLease,
        window: Duration,
    ) -> Result<Option<Renewal>, EtcdError> {
        let vouched = self.keepalive.lasts(session.id, Duration::ZERO);
        let renewal = (self.renew_lease(session.id, window, session.ttl_secs)).await?;
        if renewal.alive() {
            return Ok(Some(renewal));
        }
        self.session_gone(holder, session, vouched).await;
        Ok(None)
    }

    /// `holder`'s `session` was found gone: it is forgotten, so that its
    /// next acquire gets a new one. `vouched`: its last confirmed renewal
    /// said it lasted when it was asked about, so it ended early (etcd's
    /// lease bugs, an operator's revoke), and leases granted or renewed
    /// before now may be gone too: the spares and the emptied queue
    /// entries' leases are dropped, and no idle session's lease confirmed
    /// before now is handed on
    /// ([`Spares::flush`](super::spares::Spares::flush)).
    pub async fn session_gone(&self, holder: &str, session: &SessionLease, vouched: bool) {
        if vouched {
            self.spares.flush();
            self.entry_leases.drop_all();
        }
        self.forget_session(holder, session).await;
    }

    /// Renews `lease` unless a keepalive for it is in flight or was
    /// confirmed less than `window` ago, and answers what the router then
    /// knows of it. A keepalive it sends goes out at once: its caller waits
    /// on it.
    pub async fn renew_lease(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        self.keepalive.refresh(lease, window, ttl_secs).await
    }

    /// The last renewal of `lease` etcd confirmed, unless it is known gone
    /// since or its deadline passed: what a grant on it is answered with when the keepalive sent
    /// beside its txn went unanswered (the key is on the lease, which
    /// lasts at least that long).
    pub fn confirmed_renewal(&self, lease: i64) -> Option<Renewal> {
        self.keepalive.confirmed(lease)
    }

    /// Forgets the sessions neither acquired through nor renewed for two
    /// TTLs plus `grace`; returns how many remain.
    pub fn sweep_sessions(&self, grace: Duration) -> usize {
        self.spares.sweep();
        self.sessions.sweep(grace)
    }
}
