//! Admin routes (`/admin/v1/*`): reload the config, show the ring and any
//! open migration, take a lock from its holder. Guarded by `admin.token`
//! or an admin principal when either is configured, else open to loopback
//! clients only.

use std::net::SocketAddr;

use super::answers::{
    json, Bumped, ClientAnswer, ForceReleased, ListedLock, LockList, RingView, SessionAnswer,
};
use super::api;
use super::error::ApiError;
use super::state::AppState;
use crate::auth::{Credential, Principals};
use crate::locks::ForceOutcome;
use crate::placement::migration::BumpRequest;
use crate::reload::ReloadError;
use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;

/// Whether `credential` may call admin routes: the admin token or an admin
/// principal; with neither configured, any loopback client.
pub fn authorize(
    principals: &Principals,
    credential: &Credential,
    peer: SocketAddr,
) -> Result<(), ApiError> {
    let guarded = principals.has_admin_token() || principals.enabled();
    let unauthenticated =
        |msg: &str| ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", msg);
    match credential {
        Credential::AdminToken => Ok(()),
        Credential::Principal(p) if p.admin => Ok(()),
        Credential::Principal(p) => Err(ApiError::forbidden(format!(
            "principal {:?} is not an admin",
            p.name
        ))),
        // Unguarded, a token (the CLI may always send one) changes nothing.
        Credential::None | Credential::Unknown if !guarded => {
            if peer.ip().to_canonical().is_loopback() {
                Ok(())
            } else {
                Err(ApiError::forbidden(
                    "admin routes answer only to loopback clients unless admin.token or an admin principal is set",
                ))
            }
        }
        Credential::Unknown if !principals.enabled() => {
            Err(ApiError::forbidden("wrong admin token"))
        }
        Credential::Unknown => Err(unauthenticated("the bearer token names no principal")),
        Credential::None => Err(unauthenticated(
            "send Authorization: Bearer <admin token or an admin principal's token>",
        )),
    }
}

/// Refuses admin calls a web page could make in the browser of someone
/// who can reach the router: any whose `Origin` is not the router's own
/// (a cross-site form post or fetch: browsers always send `Origin` on
/// those), and, while the admin routes are open to loopback clients (no
/// `admin.token`, no principals), any whose `Host` is not a loopback
/// address, `localhost` or a name in `admin.allowed_hosts` (a
/// DNS-rebinding page names its own host, and its `Origin` then matches
/// it). Callers that are not browsers (the CLI, curl, scripts) send no
/// `Origin` and name the address they dial.
pub fn check_browser(
    principals: &Principals,
    uri: &http::Uri,
    headers: &http::HeaderMap,
) -> Result<(), ApiError> {
    let host = uri.authority().map(|a| a.as_str().to_string()).or_else(|| {
        let h = headers.get(http::header::HOST)?;
        h.to_str().ok().map(str::to_string)
    });
    let refuse = |why: String| ApiError::forbidden(why);
    let open = !(principals.has_admin_token() || principals.enabled());
    if let (true, Some(host)) = (open, &host) {
        if !principals.admin_host_allowed(host_name(host)) {
            return Err(refuse(format!(
                "admin routes open to loopback clients answer only requests addressed to a                  loopback address or a name in admin.allowed_hosts, not {host:?}"
            )));
        }
    }
    if let Some(origin) = headers.get(http::header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let same = host
            .as_deref()
            .is_some_and(|host| same_origin(origin, host));
        if !same {
            return Err(refuse(format!(
                "admin routes refuse requests from another origin ({origin:?}):                  a web page may not drive them"
            )));
        }
    }
    Ok(())
}

/// The host part of a `Host` header or authority: without its port, an
/// IPv6 literal without its brackets.
fn host_name(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => authority,
    }
}

/// Whether `origin` (`scheme://host[:port]`) is the origin of a request
/// addressed to `host`, default ports aside.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false; // "null", or not an origin at all
    };
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => ":80",
        "https" => ":443",
        _ => return false,
    };
    let bare = |a: &str| a.strip_suffix(default).unwrap_or(a).to_ascii_lowercase();
    bare(authority) == bare(host)
}

/// The body of a POST that takes no fields (`{}`, or empty).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoFields {}

pub async fn reload(state: &AppState) -> api::Answer {
    match state.reloader.reload().await {
        Ok(done) => Ok((json(StatusCode::OK, &done), "reloaded")),
        // The config is fine; now is not the time, or a reload is not
        // the way.
        Err(e) if e.retry_later() || matches!(e, ReloadError::NeedsRestart(_)) => Err(
            ApiError::new(StatusCode::CONFLICT, "failed_precondition", e.to_string()),
        ),
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
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ForceReleaseBody {
    /// Why, for the log: 1 to 512 bytes.
    pub reason: String,
    /// Take the name only from the grant with this token (the one the
    /// operator inspected), never from a holder that took it since.
    #[serde(default)]
    pub fencing_token: Option<u64>,
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
    let answer = match locks.force_release(name, body.fencing_token).await? {
        ForceOutcome::Released(f) => {
            crate::metrics::force_release(&f.shard);
            let (principal, client_id) = crate::locks::split_holder(&f.client_id);
            tracing::warn!(
                name,
                shard = %f.shard,
                fencing_token = f.fencing_token,
                holder = %client_id,
                principal,
                reason,
                caller = %caller.ip(),
                "lock force-released"
            );
            ForceReleased {
                name: name.to_string(),
                released: true,
                shard: Some(f.shard.clone()),
                fencing_token: Some(f.fencing_token),
                principal: Some(principal.to_string()).filter(|p| !p.is_empty()),
                client_id: Some(client_id.to_string()),
            }
        }
        ForceOutcome::Free => ForceReleased {
            name: name.to_string(),
            released: false,
            shard: None,
            fencing_token: None,
            principal: None,
            client_id: None,
        },
        ForceOutcome::OtherGrant { fencing_token } => {
            return Err(ApiError::failed_precondition(format!(
                "{name:?} is held under fencing token {fencing_token}, not the one given: \
                 nothing was released (inspect it again)"
            )));
        }
    };
    let label = if answer.released { "released" } else { "free" };
    Ok((json(StatusCode::OK, &answer), label))
}

/// Named query parameters of `query`, each at most once, and no others.
fn query_params(query: Option<&str>, known: &[&str]) -> Result<Vec<(String, String)>, ApiError> {
    let mut seen: Vec<(String, String)> = Vec::new();
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if !known.contains(&k.as_ref()) {
            return Err(ApiError::invalid(format!(
                "unknown query parameter {k:?}; known: {}",
                known.join(", ")
            )));
        }
        if seen.iter().any(|(s, _)| *s == k) {
            return Err(ApiError::invalid(format!(
                "query parameter {k:?} is given twice"
            )));
        }
        seen.push((k.into_owned(), v.into_owned()));
    }
    Ok(seen)
}

/// `GET /admin/v1/locks`'s query: `prefix`, `cursor`, `limit` (1 to 1000,
/// default 100).
pub struct LocksQuery {
    prefix: String,
    cursor: Option<String>,
    limit: usize,
}

impl LocksQuery {
    pub fn parse(query: Option<&str>) -> Result<Self, ApiError> {
        let mut q = Self {
            prefix: String::new(),
            cursor: None,
            limit: 100,
        };
        for (k, v) in query_params(query, &["prefix", "cursor", "limit"])? {
            match k.as_str() {
                "prefix" => q.prefix = v,
                "cursor" => q.cursor = Some(v),
                _ => {
                    q.limit = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or_else(|| ApiError::invalid("limit must be 1 to 1000"))?
                }
            }
        }
        Ok(q)
    }
}

/// Lists held locks, a page at a time.
pub async fn list_locks(locks: &crate::locks::Locks, q: LocksQuery) -> api::Answer {
    let page = locks
        .list_locks(&q.prefix, q.cursor.as_deref(), q.limit)
        .await?;
    let body = LockList {
        locks: page.locks.iter().map(ListedLock::of).collect(),
        next_cursor: page.next,
    };
    Ok((json(StatusCode::OK, &body), "ok"))
}

/// `GET /admin/v1/clients/{clientId}`'s query: the `principal` the
/// clientId belongs to, when principals are configured.
pub struct ClientQuery {
    principal: Option<String>,
}

impl ClientQuery {
    pub fn parse(query: Option<&str>) -> Result<Self, ApiError> {
        let principal = query_params(query, &["principal"])?.pop().map(|(_, v)| v);
        Ok(Self { principal })
    }
}

/// What one client holds: its locks and their session leases.
pub async fn client(locks: &crate::locks::Locks, client_id: &str, q: ClientQuery) -> api::Answer {
    let caller = match &q.principal {
        Some(name) => crate::locks::Caller::Principal {
            name,
            quota: Default::default(),
        },
        None => crate::locks::Caller::Anyone,
    };
    let view = locks
        .client_view(&crate::locks::Holder::new(caller, client_id))
        .await?;
    let body = ClientAnswer {
        client_id: client_id.to_string(),
        principal: q.principal,
        locks: view.locks.iter().map(ListedLock::of).collect(),
        sessions: view.sessions.iter().map(SessionAnswer::of).collect(),
        truncated: view.truncated,
    };
    Ok((json(StatusCode::OK, &body), "ok"))
}

pub fn ring(locks: &crate::locks::Locks) -> (Response<Full<Bytes>>, &'static str) {
    (
        json(StatusCode::OK, &RingView::of(&locks.active().router)),
        "ok",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::PeerIdentity;
    use crate::config::AuthSettings;

    #[test]
    fn admin_routes_need_the_token_once_it_is_set_and_loopback_before() {
        let open = Principals::new(&AuthSettings::default(), None).unwrap();
        let guarded =
            Principals::new(&AuthSettings::default(), Some("an-admin-token-0123")).unwrap();
        let (local, remote): (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().unwrap(),
            "192.0.2.1:1".parse().unwrap(),
        );
        let none = PeerIdentity::default();
        let status = |p: &Principals, header: Option<&[u8]>, peer| {
            authorize(p, &p.identify(header, &none), peer).map_err(|e| e.status.as_u16())
        };
        assert_eq!(status(&open, None, local), Ok(()));
        assert_eq!(
            status(&open, Some(b"Bearer anything"), local),
            Ok(()),
            "a stray token"
        );
        assert_eq!(status(&open, None, remote), Err(403));
        assert_eq!(status(&guarded, None, local), Err(401));
        assert_eq!(status(&guarded, Some(b"Bearer wrong"), local), Err(403));
        assert_eq!(
            status(&guarded, Some(b"Bearer an-admin-token-0123"), remote),
            Ok(())
        );
    }
}
