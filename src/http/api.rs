//! The lock routes: their request bodies (camelCase JSON, unknown fields
//! refused) and the handlers that turn them into lock operations and their
//! results into typed answers.

use std::borrow::Cow;
use std::time::Instant;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use serde::Deserialize;

use super::answers::{
    json, renew_batch_answer, renewal, ExtendedLock, Granted, Inspected, NotAcquired, NotRenewed,
    RenewAnswer, Renewed, Times, TimesAt,
};
use super::error::ApiError;
use crate::locks::{split_holder, AcquireRequest, Acquired, Caller, Extended, Locks, RenewOutcome};

pub type Answer = Result<(Response<Full<Bytes>>, &'static str), ApiError>;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireBody {
    name: String,
    ttl_ms: u64,
    client_id: String,
    #[serde(default)]
    wait_ms: u64,
    #[serde(default)]
    metadata: Option<serde_json::Value>,
}

impl AcquireBody {
    pub fn wait_ms(&self) -> u64 {
        self.wait_ms
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn client_id(&self) -> &str {
        &self.client_id
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewBody {
    lock_id: String,
    fencing_token: u64,
    #[serde(default)]
    ttl_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LockRef {
    lock_id: String,
    fencing_token: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtendBody {
    lock_id: String,
    fencing_token: u64,
    ttl_ms: u64,
}

/// A lock of a renew-batch: its lockId borrowed from the body unless the
/// JSON escaped a character of it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchRef<'a> {
    #[serde(borrow)]
    lock_id: Cow<'a, str>,
    fencing_token: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewBatchBody<'a> {
    #[serde(borrow)]
    locks: Vec<BatchRef<'a>>,
}

/// The lock routes' handlers take `received`, when the request arrived: the
/// locks layer counts each shard's latency from then.
pub async fn acquire(
    locks: &Locks,
    body: AcquireBody,
    caller: Caller<'_>,
    received: Instant,
) -> Answer {
    let req = AcquireRequest {
        name: body.name,
        ttl_ms: body.ttl_ms,
        client_id: body.client_id,
        wait_ms: body.wait_ms,
        metadata: body.metadata,
        received,
    };
    Ok(match locks.acquire(req, caller).await? {
        Acquired::Granted(g) => {
            let body = Granted {
                acquired: true,
                lock_id: g.lock_id,
                fencing_token: g.fencing_token,
                times: Times::of(&g.expires),
            };
            (json(StatusCode::OK, &body), "acquired")
        }
        Acquired::Held(e) => {
            let body = NotAcquired {
                acquired: false,
                expires_at: Times::of(&e).expires_at,
            };
            (json(StatusCode::OK, &body), "not_acquired")
        }
    })
}

pub async fn renew(
    locks: &Locks,
    body: RenewBody,
    caller: Caller<'_>,
    received: Instant,
) -> Answer {
    let outcome = locks
        .renew(
            &body.lock_id,
            body.fencing_token,
            body.ttl_ms,
            caller,
            received,
        )
        .await?;
    let (answer, label) = renew_answer(&outcome, &mut TimesAt::now());
    let status = match answer {
        RenewAnswer::Renewed(_) => StatusCode::OK,
        RenewAnswer::NotRenewed(_) => StatusCode::CONFLICT,
    };
    Ok((json(status, &answer), label))
}

pub async fn renew_batch(
    locks: &Locks,
    body: RenewBatchBody<'_>,
    caller: Caller<'_>,
    received: Instant,
) -> Answer {
    let items: Vec<(&str, u64)> = (body.locks.iter())
        .map(|l| (l.lock_id.as_ref(), l.fencing_token))
        .collect();
    let outcomes = locks.renew_batch(&items, caller, received).await?;
    Ok((renew_batch_answer(&items, &outcomes), "ok"))
}

/// A renewal's answer body and its metrics outcome.
fn renew_answer(o: &RenewOutcome, times: &mut TimesAt) -> (RenewAnswer, &'static str) {
    match renewal(o) {
        Ok(e) => {
            let answer = Renewed {
                renewed: true,
                times: times.of(e),
            };
            (RenewAnswer::Renewed(answer), "renewed")
        }
        Err(reason) => {
            let answer = NotRenewed {
                renewed: false,
                reason,
            };
            (RenewAnswer::NotRenewed(answer), reason)
        }
    }
}

/// Extends a lock to a new TTL: moved onto the session lease of that TTL,
/// with the same fencing token and a new lockId.
pub async fn extend(
    locks: &Locks,
    body: ExtendBody,
    caller: Caller<'_>,
    received: Instant,
) -> Answer {
    let extended = locks
        .extend(
            &body.lock_id,
            body.fencing_token,
            body.ttl_ms,
            caller,
            received,
        )
        .await?;
    Ok(match extended {
        Extended::Moved(g) => {
            let body = ExtendedLock {
                renewed: true,
                lock_id: g.lock_id,
                fencing_token: g.fencing_token,
                times: Times::of(&g.expires),
            };
            (json(StatusCode::OK, &body), "renewed")
        }
        Extended::Refused(o) => {
            let (answer, label) = renew_answer(&o, &mut TimesAt::now());
            (json(StatusCode::CONFLICT, &answer), label)
        }
    })
}

pub async fn release(locks: &Locks, body: LockRef, caller: Caller<'_>) -> Answer {
    locks
        .release(&body.lock_id, body.fencing_token, caller)
        .await?;
    let resp = Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Full::new(Bytes::new()))
        .expect("static response");
    Ok((resp, "released"))
}

/// `admin`: the caller passed the admin guard, and is shown the holder's
/// clientId.
pub async fn inspect(locks: &Locks, name: &str, admin: bool) -> Answer {
    let found = locks.inspect(name).await?;
    let held = found.holder.is_some();
    let body = Inspected {
        name: name.to_string(),
        held,
        fencing_token: found.holder.map(|(token, _)| token),
        expires_at: found.holder.map(|(_, e)| Times::of(&e).expires_at),
        acquired_at: found
            .acquired_at
            .map(|t| humantime::format_rfc3339_millis(t).to_string()),
        metadata: found.metadata,
        waiters: Some(found.waiters).filter(|n| *n > 0),
        principal: found
            .client_id
            .as_deref()
            .map(|h| split_holder(h).0)
            .filter(|p| admin && !p.is_empty())
            .map(str::to_string),
        client_id: found
            .client_id
            .as_deref()
            .filter(|_| admin)
            .map(|h| split_holder(h).1.to_string()),
        shard: found.shard,
    };
    let label = if held { "held" } else { "free" };
    Ok((json(StatusCode::OK, &body), label))
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    /// The size of the future a handler of three arguments returns.
    fn size3<A, B, C, F: Future>(_: fn(A, B, C) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    fn size4<A, B, C, D, F: Future>(_: fn(A, B, C, D) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// A handler's future is copied whole as it is built and moved (into
    /// the heap, under the request's deadline) on every request. One that
    /// holds an etcd call inline is kilobytes larger: the acquire handler's
    /// was 16,792 bytes while the hedged reads kept theirs inline
    /// (`EtcdConn::call_hedged`), 5,328 with every call on the heap.
    #[test]
    fn the_lock_handlers_futures_hold_no_etcd_call_inline() {
        const MOST: usize = 8 * 1024;
        let sizes = [
            (
                "acquire",
                size4::<&Locks, AcquireBody, Caller, Instant, _>(acquire),
            ),
            (
                "extend",
                size4::<&Locks, ExtendBody, Caller, Instant, _>(extend),
            ),
            (
                "renew",
                size4::<&Locks, RenewBody, Caller, Instant, _>(renew),
            ),
            (
                "renew-batch",
                size4::<&Locks, RenewBatchBody, Caller, Instant, _>(renew_batch),
            ),
            ("release", size3::<&Locks, LockRef, Caller, _>(release)),
            ("inspect", size3::<&Locks, &str, bool, _>(inspect)),
        ];
        for (handler, size) in sizes {
            assert!(
                size <= MOST,
                "the {handler} handler's future is {size} bytes"
            );
        }
    }

    /// The acquire handler's future holds none of its rarer paths' futures
    /// (a waiting acquire's queue, the read of a name shown held, a
    /// refused grant's settling) nor the grant's own (its txn and
    /// keepalive side by side): each goes to the heap when taken. Inline
    /// they made it 5,328 bytes; 3,120 without them.
    #[test]
    fn the_acquire_handlers_future_holds_no_grant_or_queue_inline() {
        let size = size4::<&Locks, AcquireBody, Caller, Instant, _>(acquire);
        assert!(
            size <= 4 * 1024,
            "the acquire handler's future is {size} bytes"
        );
    }
}
