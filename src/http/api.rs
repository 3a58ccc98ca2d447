//! The v1 endpoints: request and response bodies (camelCase JSON) and the
//! handlers that turn them into lock operations.

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::error::ApiError;
use super::json;
use crate::locks::{AcquireRequest, Acquired, Expiry, Locks, RenewOutcome};

pub type Answer = Result<(Response<Full<Bytes>>, &'static str), ApiError>;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireBody {
    name: String,
    ttl_ms: u64,
    client_id: String,
    #[serde(default)]
    wait_ms: u64,
}

impl AcquireBody {
    pub fn wait_ms(&self) -> u64 {
        self.wait_ms
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
pub struct RenewBatchBody {
    locks: Vec<LockRef>,
}

/// `expiresAt` (RFC 3339 UTC, milliseconds) and `expiresInMs` of one clock read.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Times {
    expires_at: String,
    expires_in_ms: u64,
}

fn times(e: &Expiry) -> Times {
    let (ms, at) = e.report();
    Times {
        expires_at: humantime::format_rfc3339_millis(at).to_string(),
        expires_in_ms: ms,
    }
}

pub async fn acquire(locks: &Locks, body: AcquireBody) -> Answer {
    let req = AcquireRequest {
        name: body.name,
        ttl_ms: body.ttl_ms,
        client_id: body.client_id,
        wait_ms: body.wait_ms,
    };
    Ok(match locks.acquire(&req).await? {
        Acquired::Granted(g) => {
            let t = times(&g.expires);
            let body = json!({
                "acquired": true, "lockId": g.lock_id, "fencingToken": g.fencing_token,
                "expiresAt": t.expires_at, "expiresInMs": t.expires_in_ms,
            });
            (json(StatusCode::OK, &body), "acquired")
        }
        Acquired::Held(e) => {
            let body = json!({"acquired": false, "expiresAt": times(&e).expires_at});
            (json(StatusCode::OK, &body), "not_acquired")
        }
    })
}

pub async fn renew(locks: &Locks, body: RenewBody) -> Answer {
    let outcome = locks
        .renew(&body.lock_id, body.fencing_token, body.ttl_ms)
        .await?;
    let (status, value, label) = renewed_json(&outcome);
    Ok((json(status, &value), label))
}

pub async fn renew_batch(locks: &Locks, body: RenewBatchBody) -> Answer {
    let items: Vec<(String, u64)> = body
        .locks
        .into_iter()
        .map(|l| (l.lock_id, l.fencing_token))
        .collect();
    let outcomes = locks.renew_batch(&items).await?;
    let results: Vec<serde_json::Value> = items
        .iter()
        .zip(&outcomes)
        .map(|((lock_id, _), o)| {
            let mut v = renewed_json(o).1;
            v["lockId"] = json!(lock_id);
            v
        })
        .collect();
    Ok((json(StatusCode::OK, &json!({ "results": results })), "ok"))
}

fn renewed_json(o: &RenewOutcome) -> (StatusCode, serde_json::Value, &'static str) {
    let refused = |reason: &'static str| {
        (
            StatusCode::CONFLICT,
            json!({"renewed": false, "reason": reason}),
            reason,
        )
    };
    match o {
        RenewOutcome::Renewed(e) => {
            let t = times(e);
            let v =
                json!({"renewed": true, "expiresAt": t.expires_at, "expiresInMs": t.expires_in_ms});
            (StatusCode::OK, v, "renewed")
        }
        RenewOutcome::Expired => refused("expired"),
        RenewOutcome::Stolen => refused("stolen"),
        RenewOutcome::Unavailable => refused("shard_unavailable"),
    }
}

pub async fn release(locks: &Locks, body: LockRef) -> Answer {
    locks.release(&body.lock_id, body.fencing_token).await?;
    let resp = Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(Full::new(Bytes::new()))
        .expect("static response");
    Ok((resp, "released"))
}

pub async fn inspect(locks: &Locks, name: &str) -> Answer {
    let found = locks.inspect(name).await?;
    Ok(match found.holder {
        Some((token, e)) => {
            let body = json!({
                "name": name, "held": true, "fencingToken": token,
                "expiresAt": times(&e).expires_at, "shard": found.shard,
            });
            (json(StatusCode::OK, &body), "held")
        }
        None => (
            json(
                StatusCode::OK,
                &json!({"name": name, "held": false, "shard": found.shard}),
            ),
            "free",
        ),
    })
}
