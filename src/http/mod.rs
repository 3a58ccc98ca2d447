//! The HTTP layer: hyper 1 on tokio, HTTP/1.1 keep-alive and HTTP/2 (h2c)
//! on one port, routing, body limits, JSON parsing, and graceful shutdown.
//! Handlers live in `api.rs`; error mapping in `error.rs`.

pub mod admin;
pub mod api;
pub mod error;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::HttpTimeouts;
use crate::locks::Locks;
use crate::metrics as m;
use crate::reload::Reloader;
use error::ApiError;

/// Every route the server answers, as `(method, path template)`. The
/// OpenAPI document is tested against this list.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/api/v1/locks/acquire"),
    ("POST", "/api/v1/locks/renew"),
    ("POST", "/api/v1/locks/renew-batch"),
    ("POST", "/api/v1/locks/release"),
    ("GET", "/api/v1/locks/{name}"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("POST", "/admin/v1/reload"),
    ("POST", "/admin/v1/bump-epoch"),
    ("GET", "/admin/v1/ring"),
];

const LOCKS_PREFIX: &str = "/api/v1/locks/";

/// What every request handler shares.
pub struct AppState {
    pub locks: Arc<Locks>,
    pub reloader: Arc<Reloader>,
    /// Bearer token for `/admin/v1/*`; without one, loopback clients only.
    pub admin_token: Option<String>,
    pub metrics: PrometheusHandle,
    /// Header, body and whole-request deadlines.
    pub timeouts: HttpTimeouts,
}

/// Which routes a listener serves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    Main,
    MetricsOnly,
}

/// Serves `listener` until `shutdown`, then lets in-flight requests finish
/// for up to `grace`.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    kind: Listener,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(state.timeouts.header_read);
    // HTTP/2 pings find peers that went away without closing.
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10));
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: back off, go on.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let svc = service_fn(move |req| handle(state.clone(), kind, peer, req));
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            let _ = watcher.watch(conn).await;
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace period ended with requests still in flight");
    }
}

async fn handle(
    state: Arc<AppState>,
    kind: Listener,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let started = Instant::now();
    let op = op_of(req.method(), req.uri().path(), kind);
    let span = tracing::debug_span!(
        "request",
        op,
        shard = tracing::field::Empty,
        outcome = tracing::field::Empty
    );
    let result = route(&state, op, peer, req).instrument(span.clone()).await;
    let (resp, outcome) = match result {
        Ok(ok) => ok,
        Err(e) => {
            let code = e.code;
            (e.into_response(), code)
        }
    };
    span.record("outcome", outcome);
    // A 503 from /readyz is an answer, not a failure (probes ask often).
    if resp.status().is_server_error() && op != "readyz" {
        tracing::warn!(
            op,
            outcome,
            status = resp.status().as_u16(),
            "request failed"
        );
    }
    m::request(op, outcome, started.elapsed());
    Ok(resp)
}

/// The route of a request, also its metrics label (never the path itself,
/// which may hold a lock name). GET below `/api/v1/locks/` is always an
/// inspect, so a lock may be named "acquire" or "renew" like any other.
fn op_of(method: &Method, path: &str, kind: Listener) -> &'static str {
    match (kind, path) {
        (_, "/metrics") => "metrics",
        (Listener::MetricsOnly, _) => "unknown",
        (_, p) if p.starts_with(LOCKS_PREFIX) && method == Method::GET => "inspect",
        (_, "/api/v1/locks/acquire") => "acquire",
        (_, "/api/v1/locks/renew") => "renew",
        (_, "/api/v1/locks/renew-batch") => "renew_batch",
        (_, "/api/v1/locks/release") => "release",
        (_, "/healthz") => "healthz",
        (_, "/readyz") => "readyz",
        (_, "/admin/v1/reload") => "admin_reload",
        (_, "/admin/v1/bump-epoch") => "admin_bump_epoch",
        (_, "/admin/v1/ring") => "admin_ring",
        (_, p) if p.starts_with(LOCKS_PREFIX) => "inspect",
        _ => "unknown",
    }
}

async fn route(
    state: &AppState,
    op: &'static str,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> api::Answer {
    let active = state.locks.active();
    let (max, max_wait) = (active.limits.max_body_bytes, active.limits.max_wait_ms);
    drop(active);
    let t = state.timeouts;
    let locks = &state.locks;
    match op {
        "acquire" => {
            let body: api::AcquireBody = parse(req, max, t.body_read).await?;
            // A waiting acquire may take its waitMs on top of the deadline.
            let wait = Duration::from_millis(body.wait_ms().min(max_wait));
            within(t.request + wait, api::acquire(locks, body)).await
        }
        "renew" => {
            within(
                t.request,
                api::renew(locks, parse(req, max, t.body_read).await?),
            )
            .await
        }
        "renew_batch" => {
            let body = parse(req, max, t.body_read).await?;
            within(t.request, api::renew_batch(locks, body)).await
        }
        "release" => {
            within(
                t.request,
                api::release(locks, parse(req, max, t.body_read).await?),
            )
            .await
        }
        "inspect" => {
            only(&req, Method::GET, "GET")?;
            let raw = &req.uri().path()[LOCKS_PREFIX.len()..];
            let name = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .map_err(|_| {
                    ApiError::invalid("the name in the path is not percent-encoded UTF-8")
                })?;
            within(t.request, api::inspect(locks, &name)).await
        }
        "healthz" => {
            only(&req, Method::GET, "GET")?;
            Ok((
                json(StatusCode::OK, &serde_json::json!({"status": "ok"})),
                "ok",
            ))
        }
        "readyz" => {
            only(&req, Method::GET, "GET")?;
            Ok(readyz(locks))
        }
        "admin_reload" => {
            only(&req, Method::POST, "POST")?;
            admin::authorize(state, peer, &req)?;
            within(t.request, admin::reload(state)).await
        }
        "admin_bump_epoch" => {
            only(&req, Method::POST, "POST")?;
            admin::authorize(state, peer, &req)?;
            let body = parse_optional(req, max, t.body_read).await?;
            within(t.request, admin::bump_epoch(state, body)).await
        }
        "admin_ring" => {
            only(&req, Method::GET, "GET")?;
            admin::authorize(state, peer, &req)?;
            Ok(admin::ring(state))
        }
        "metrics" => {
            only(&req, Method::GET, "GET")?;
            crate::metrics::collect_process();
            state.metrics.run_upkeep();
            let resp = Response::builder()
                .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
                .body(Full::new(Bytes::from(state.metrics.render())))
                .expect("static response");
            Ok((resp, "ok"))
        }
        _ => Err(ApiError::not_found()),
    }
}

/// Runs a handler under the request's deadline: past it, 504 `timeout`.
/// Dropping the handler is safe: every etcd write it may have sent is
/// either done or not, and a retry with the same clientId finds it.
async fn within(
    deadline: Duration,
    handler: impl std::future::Future<Output = api::Answer>,
) -> api::Answer {
    match tokio::time::timeout(deadline, handler).await {
        Ok(answer) => answer,
        Err(_) => Err(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!("no answer within {} ms; retry", deadline.as_millis()),
        )),
    }
}

fn readyz(locks: &Locks) -> (Response<Full<Bytes>>, &'static str) {
    let router = locks.active().router.clone();
    let (down, refusing) = router.readiness();
    let shards: Vec<serde_json::Value> = router
        .shard_states()
        .into_iter()
        .map(|(name, state)| serde_json::json!({"name": name, "state": state}))
        .collect();
    let ready = router.ready();
    let body = serde_json::json!({
        "ready": ready,
        "shards": shards,
        "unreachableShards": down,
        "refusingShards": refusing,
        "migration": admin::migration_json(&router),
    });
    if ready {
        (json(StatusCode::OK, &body), "ready")
    } else {
        (json(StatusCode::SERVICE_UNAVAILABLE, &body), "not_ready")
    }
}

fn only(req: &Request<Incoming>, method: Method, allow: &'static str) -> Result<(), ApiError> {
    if req.method() == method {
        Ok(())
    } else {
        Err(ApiError::method_not_allowed(allow))
    }
}

/// Checks method, media type and size, then parses the JSON body.
async fn parse<T: DeserializeOwned>(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<T, ApiError> {
    only(&req, Method::POST, "POST")?;
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as Content-Type: application/json",
        ));
    }
    let body = read_body(req, max, deadline).await?;
    from_json(&body)
}

/// Like [`parse`], but an empty body (with or without a media type) is
/// the default value.
async fn parse_optional<T: DeserializeOwned + Default>(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<T, ApiError> {
    let typed = req.headers().contains_key(header::CONTENT_TYPE);
    let declared_empty = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .is_some_and(|v| v.as_bytes() == b"0");
    if typed && !declared_empty {
        return parse(req, max, deadline).await;
    }
    let body = read_body(req, max, deadline).await?;
    if body.is_empty() {
        return Ok(T::default());
    }
    Err(ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        "send the body as Content-Type: application/json",
    ))
}

/// Reads at most `max` bytes of body within `deadline`.
async fn read_body(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body may be at most {max} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let collect = Limited::new(req.into_body(), max).collect();
    let collected = tokio::time::timeout(deadline, collect).await.map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            format!("the body did not arrive within {} ms", deadline.as_millis()),
        )
    })?;
    Ok(collected
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                too_large()
            } else {
                ApiError::invalid(format!("could not read the body: {e}"))
            }
        })?
        .to_bytes())
}

/// Parses JSON; the error names where in the body it went wrong.
fn from_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // The fast path first; only a body that fails is parsed again to find
    // the path of the problem.
    if let Ok(value) = serde_json::from_slice(body) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Ok(value) => Ok(value),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Err(if path.is_empty() || path == "." {
                ApiError::invalid(format!("invalid JSON body: {inner}"))
            } else {
                ApiError::invalid(format!("invalid JSON body: {path}: {inner}"))
            })
        }
    }
}

/// A JSON response.
pub fn json(status: StatusCode, value: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
