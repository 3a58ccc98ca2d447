//! Admin routes (`/admin/v1/*`): reload the config, show the ring and any
//! open migration, take a lock from its holder. Guarded by a bearer token when one is configured, else
//! open to loopback clients only.

use std::net::SocketAddr;

use super::answers::{json, Bumped, ForceReleased, RingView};
use super::api;
use super::error::ApiError;
use super::state::AppState;
use crate::placement::migration::BumpRequest;
use crate::reload::ReloadError;
use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;

pub fn authorize(
    state: &AppState,
    peer: SocketAddr,
    req: &Request<Incoming>,
) -> Result<(), ApiError> {
    let Some(token) = &state.admin_token else {
        if peer.ip().to_canonical().is_loopback() {
            return Ok(());
        }
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_denied",
            "admin routes answer only to loopback clients unless admin.token is set",
        ));
    };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "send Authorization: Bearer <admin token>",
        )),
        Some(t) if constant_time_eq(t.as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_denied",
            "wrong admin token",
        )),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub async fn reload(state: &AppState) -> api::Answer {
    match state.reloader.reload().await {
        Ok(done) => Ok((json(StatusCode::OK, &done), "reloaded")),
        Err(ReloadError::Refused(msg) | ReloadError::NeedsRestart(msg)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "failed_precondition",
            msg,
        )),
        Err(e) => Err(ApiError::invalid(e.to_string())),
    }
}

pub async fn bump_epoch(state: &AppState, req: BumpRequest) -> api::Answer {
    match state.reloader.bump_epoch(&req).await {
        Ok(epoch) => Ok((json(StatusCode::OK, &Bumped { epoch }), "bumped")),
        Err(e) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "failed_precondition",
            e.to_string(),
        )),
    }
}

/// `POST /admin/v1/locks/{name}/force-release`'s body.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForceReleaseBody {
    /// Why, for the log: 1 to 512 bytes.
    pub reason: String,
}

/// Takes `name` from its holder; logs who did it and why.
pub async fn force_release(
    locks: &crate::locks::Locks,
    name: &str,
    body: ForceReleaseBody,
    caller: SocketAddr,
) -> api::Answer {
    let reason = body.reason.trim();
    if reason.is_empty() || reason.len() > 512 {
        return Err(ApiError::invalid("reason must be 1 to 512 bytes"));
    }
    let forced = locks.force_release(name).await?;
    let answer = match forced {
        Some(f) => {
            crate::metrics::force_release(&f.shard);
            tracing::warn!(
                name,
                shard = %f.shard,
                fencing_token = f.fencing_token,
                holder = %f.client_id,
                reason,
                caller = %caller.ip(),
                "lock force-released"
            );
            ForceReleased {
                name: name.to_string(),
                released: true,
                shard: Some(f.shard),
                fencing_token: Some(f.fencing_token),
                client_id: Some(f.client_id),
            }
        }
        None => ForceReleased {
            name: name.to_string(),
            released: false,
            shard: None,
            fencing_token: None,
            client_id: None,
        },
    };
    let label = if answer.released { "released" } else { "free" };
    Ok((json(StatusCode::OK, &answer), label))
}

pub fn ring(state: &AppState) -> (Response<Full<Bytes>>, &'static str) {
    let router = state.locks.active().router.clone();
    (json(StatusCode::OK, &RingView::of(&router)), "ok")
}
