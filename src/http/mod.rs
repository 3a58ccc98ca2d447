//! The HTTP layer: hyper 1 on tokio, HTTP/1.1 keep-alive and HTTP/2 (h2c)
//! on one port, deadlines, a bound on requests in flight ([`admission`]),
//! and graceful shutdown. The route table is in
//! [`routes`]; request bodies in [`body`]; the lock routes' handlers in
//! [`api`], the admin routes' in [`admin`]; every answer body is a type in
//! [`answers`]; [`error`] is the one place an error becomes a response;
//! [`request_id`] names each request in its answer and its log lines;
//! [`access`] is the access log (`server.access_log`); [`failure_log`]
//! says which failed requests get a line of their own;
//! [`caller`] says which principal a lock API request acts for;
//! [`state`] is what every handler shares; [`ui`] is the status page;
//! [`tls`] reads the main listener's certificates; [`protocol`] puts
//! hyper's own refusals of unreadable requests in the API's error
//! envelope. TLS, the principals, the deadlines and the access log's
//! switch come with the generation in force ([`crate::generation`]), which
//! builds them: `tls` is the one part of this layer that the generation,
//! below it, calls (it has a layer of its own in `layout.rs`, below
//! `generation`, and imports nothing else of `http`).

pub mod access;
pub mod admin;
pub mod admission;
pub mod answers;
pub mod api;
pub mod body;
pub mod caller;
pub mod error;
pub mod failure_log;
pub mod protocol;
pub mod request_id;
pub mod routes;
pub mod state;
pub mod tls;
pub mod ui;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::auth::PeerIdentity;
use crate::generation::Current;
use crate::locks::Locks;
use crate::metrics as m;
use error::ApiError;

pub use answers::json;
pub use routes::{Listener, Route};
pub use state::AppState;

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
    builder.http1().timer(TokioTimer::new());
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
        // A connection keeps the TLS config and header deadline of the
        // generation in force when it was accepted.
        let current = state.in_force.current();
        let tls = match kind {
            Listener::Main => current.front.tls.clone(),
            Listener::MetricsOnly => None,
        };
        let handshake_within = current.front.timeouts.header_read;
        drop(current);
        let state = state.clone();
        let mut builder = builder.clone();
        builder.http1().header_read_timeout(handshake_within);
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let Some(config) = tls else {
                let who = Arc::new(PeerIdentity::default());
                let svc =
                    service_fn(move |req| handle(state.clone(), kind, peer, who.clone(), req));
                let io = TokioIo::new(protocol::JsonRefusals::new(stream));
                let conn = builder.serve_connection(io, svc);
                let _ = watcher.watch(conn).await;
                return;
            };
            // A client that does not finish its handshake in time is
            // dropped, as one that does not send its headers is.
            let acceptor = tokio_rustls::TlsAcceptor::from(config);
            let stream = match tokio::time::timeout(handshake_within, acceptor.accept(stream)).await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            // The client certificate (mTLS) names the caller for the whole
            // connection.
            let who = Arc::new(PeerIdentity::of(stream.get_ref().1.peer_certificates()));
            let svc = service_fn(move |req| handle(state.clone(), kind, peer, who.clone(), req));
            let io = TokioIo::new(protocol::JsonRefusals::new(stream));
            let conn = builder.serve_connection(io, svc);
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
    who: Arc<PeerIdentity>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let started = Instant::now();
    let route = Route::of(req.method(), req.uri().path(), kind);
    let op = route.map_or("unknown", Route::label);
    let request_id = request_id::of(req.headers());
    let method = req.method().clone();
    let counted = !ui::is_poll(&method, route, req.headers());
    // Every line logged while serving the request names it, and its shard
    // and outcome once known: the log reads these only when it writes one.
    // The serving goes to the heap: kept inline, its kilobytes would make
    // this future that large, and hyper copies this future into its slot
    // for every request on a connection.
    let names = crate::task::RequestNames::new(op, request_id.clone());
    crate::task::naming(
        names,
        Box::pin(async move {
            // One generation serves the whole request, whatever a reload puts in
            // force meanwhile.
            let current = state.in_force.current();
            let mut facts = access::Facts::of(current.front.access_log);
            let result = match route {
                Some(route) => {
                    dispatch(
                        &state, &current, route, peer, &who, req, &mut facts, started,
                    )
                    .await
                }
                None => Err(ApiError::not_found()),
            };
            let (mut resp, outcome) = match result {
                Ok(ok) => ok,
                Err(e) => {
                    let code = e.code;
                    (e.into_response(Some(&request_id)), code)
                }
            };
            if let Ok(value) = http::HeaderValue::from_str(&request_id) {
                resp.headers_mut().insert(request_id::HEADER_NAME, value);
            }
            crate::task::name_outcome(outcome);
            // A 503 from /readyz is an answer, not a failure (probes ask often).
            // Failures are logged one by one only while few (failure_log.rs): a
            // request shed as `overloaded` gets one line a second at most, counting
            // the refusals since the last; any other 5xx 10 lines a second for its
            // outcome, counting those left out.
            if outcome == "overloaded" {
                if let Some(left_out) = state.failures.shed.hit() {
                    let refused = left_out + 1;
                    tracing::warn!(
                        op,
                        request_id = %request_id,
                        refused,
                        "shedding load: requests refused as overloaded since the last such line"
                    );
                }
            } else if resp.status().is_server_error() && route != Some(Route::Readyz) {
                if let Some(suppressed) = state.failures.failed(outcome) {
                    tracing::warn!(
                        op,
                        outcome,
                        request_id = %request_id,
                        status = resp.status().as_u16(),
                        suppressed,
                        "request failed"
                    );
                }
            }
            let elapsed = started.elapsed();
            if counted {
                m::request(op, outcome, elapsed);
            }
            let line = access::Line {
                method: &method,
                route: op,
                status: resp.status().as_u16(),
                elapsed,
                request_id: &request_id,
            };
            access::log(line, &facts);
            Ok(resp)
        }),
    )
    .await
}

/// Runs `route`'s handler: checks its method, who the caller is (the admin
/// guard for admin routes, a principal for the lock API when principals
/// are configured), parses its body, and applies the request's deadline.
/// `current`: the generation the request is served by, loaded once. What
/// the access log says of the request beyond its answer goes in `facts`;
/// `received`: when the request arrived.
#[allow(clippy::too_many_arguments)]
async fn dispatch(
    state: &AppState,
    current: &Current,
    route: Route,
    peer: SocketAddr,
    who: &PeerIdentity,
    req: Request<Incoming>,
    facts: &mut access::Facts,
    received: Instant,
) -> api::Answer {
    let allow = if route.method() == Method::POST {
        "POST"
    } else {
        "GET, HEAD"
    };
    // HEAD is a GET whose body hyper leaves out (headers and
    // Content-Length stay those of the GET).
    if !(route.method() == Method::GET && req.method() == Method::HEAD) {
        body::only(&req, route.method(), allow)?;
    }
    let (front, locks) = (&current.front, &current.locks);
    let principals = &front.principals;
    let authorization = req.headers().get(header::AUTHORIZATION);
    let credential = principals.identify(authorization.map(|v| v.as_bytes()), who);
    if let crate::auth::Credential::Principal(p) = &credential {
        facts.principal(&p.name);
    }
    if route.is_admin() {
        admin::check_browser(principals, req.uri(), req.headers())?;
        admin::authorize(principals, &credential, peer)?;
    }
    // Who holds a name is shown to admin callers only.
    let admin_caller =
        route == Route::Inspect && admin::authorize(principals, &credential, peer).is_ok();
    let principal = match route.is_lock_api() {
        true => caller::lock_caller(principals, credential, admin_caller)?,
        false => None,
    };
    if let Some(p) = &principal {
        m::principal_request(&p.name, route.label());
    }
    // Held until the answer is built; refused at once when full.
    let _slot = state.admission.admit(route)?;
    let limits = &locks.active().limits;
    let (max, max_wait) = (limits.max_body_bytes, limits.max_wait());
    let mut t = front.timeouts;
    let asked = client_timeout(&req)?;
    if let Some(asked) = asked {
        t.request = t.request.min(asked);
    }
    match route {
        Route::Acquire => {
            let body: api::AcquireBody = body::parse(req, max, t.body_read).await?;
            facts.client_id(body.client_id());
            if let Some(p) = &principal {
                p.may_acquire(body.name(), body.client_id())?;
            }
            let wait = Duration::from_millis(body.wait_ms()).min(max_wait);
            let deadline = match asked {
                // The caller's deadline bounds the whole request, wait included.
                Some(asked) if wait >= asked => {
                    return Err(ApiError::invalid(format!(
                        "waitMs must be below the {TIMEOUT_HEADER} header ({} ms)",
                        asked.as_millis()
                    )))
                }
                Some(_) => t.request,
                // A waiting acquire may take its waitMs on top of the deadline.
                None => t.request + wait,
            };
            within(
                deadline,
                api::acquire(locks, body, caller::as_caller(&principal), received),
            )
            .await
        }
        Route::Renew => {
            let body = body::parse(req, max, t.body_read).await?;
            within(
                t.request,
                api::renew(locks, body, caller::as_caller(&principal), received),
            )
            .await
        }
        Route::RenewBatch => {
            // Parsed in place: its lockIds borrow from the body.
            let bytes = body::read_json(req, max, t.body_read).await?;
            let body = body::from_json(&bytes)?;
            let caller = caller::as_caller(&principal);
            within(t.request, api::renew_batch(locks, body, caller, received)).await
        }
        Route::Extend => {
            let body = body::parse(req, max, t.body_read).await?;
            let caller = caller::as_caller(&principal);
            within(t.request, api::extend(locks, body, caller, received)).await
        }
        Route::Release => {
            let body = body::parse(req, max, t.body_read).await?;
            within(
                t.request,
                api::release(locks, body, caller::as_caller(&principal)),
            )
            .await
        }
        Route::Inspect => {
            let raw = &req.uri().path()[routes::LOCKS_PREFIX.len()..];
            let name = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .map_err(|_| {
                    ApiError::invalid("the name in the path is not percent-encoded UTF-8")
                })?;
            facts.name(&name);
            if let Some(p) = &principal {
                p.may_lock(&name)?;
            }
            within(t.request, api::inspect(locks, &name, admin_caller)).await
        }
        Route::AdminForceRelease => {
            let path = req.uri().path().to_string();
            let raw = &path[routes::FORCE_PREFIX.len()..path.len() - routes::FORCE_SUFFIX.len()];
            let name = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .map_err(|_| {
                    ApiError::invalid("the name in the path is not percent-encoded UTF-8")
                })?
                .into_owned();
            facts.name(&name);
            let body = body::parse(req, max, t.body_read).await?;
            within(t.request, admin::force_release(locks, &name, body, peer)).await
        }
        Route::Healthz => Ok((
            json(StatusCode::OK, &answers::Health { status: "ok" }),
            "ok",
        )),
        Route::Readyz => Ok(readyz(state, locks)),
        Route::AdminReload => {
            let _: admin::NoFields = body::parse_optional(req, max, t.body_read).await?;
            within(t.request, admin::reload(state)).await
        }
        Route::AdminBumpEpoch => {
            let body = body::parse_optional(req, max, t.body_read).await?;
            within(t.request, admin::bump_epoch(state, body)).await
        }
        Route::AdminRing => Ok(admin::ring(locks)),
        Route::AdminLocks => {
            let query = admin::LocksQuery::parse(req.uri().query())?;
            within(t.request, admin::list_locks(locks, query)).await
        }
        Route::AdminClient => {
            let raw = &req.uri().path()[routes::CLIENTS_PREFIX.len()..];
            let client = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .map_err(|_| {
                    ApiError::invalid("the clientId in the path is not percent-encoded UTF-8")
                })?
                .into_owned();
            let query = admin::ClientQuery::parse(req.uri().query())?;
            within(t.request, admin::client(locks, &client, query)).await
        }
        Route::Ui => Ok(ui::page()),
        Route::Metrics => {
            crate::metrics::collect_process();
            shard_states(locks);
            state.metrics.run_upkeep();
            let resp = Response::builder()
                .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
                .body(Full::new(Bytes::from(state.metrics.render())))
                .expect("static response");
            Ok((resp, "ok"))
        }
    }
}

/// Sets `lockrouter_shard_state` to what `/readyz` would say now.
fn shard_states(locks: &Locks) {
    use crate::placement::topology::ShardState;
    let states: Vec<_> = (locks.active().router.shard_states().into_iter())
        .map(|(name, state)| (name, state.as_str()))
        .collect();
    crate::metrics::shard_states(&states, &ShardState::ALL.map(ShardState::as_str));
}

/// The header in which a caller may ask for a shorter deadline than
/// `server.request_timeout_ms`, in milliseconds.
pub const TIMEOUT_HEADER: &str = "x-request-timeout-ms";

/// The deadline the caller asked for, if any.
fn client_timeout<B>(req: &Request<B>) -> Result<Option<Duration>, ApiError> {
    let Some(value) = req.headers().get(TIMEOUT_HEADER) else {
        return Ok(None);
    };
    let ms = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "the {TIMEOUT_HEADER} header must be a positive whole number of milliseconds"
            ))
        })?;
    Ok(Some(Duration::from_millis(ms)))
}

/// Runs a handler under the request's deadline: past it, 504 `timeout`.
/// Every etcd call the handler makes is bounded by the same deadline
/// (`EtcdConn::call`), so an answer past it is an error the handler gave
/// because time ran out, and it is answered as such. Dropping the handler
/// is safe: every etcd write it may have sent is either done or not, and a
/// retry with the same clientId finds it.
///
/// The handler goes to the heap first: a lock operation's future is
/// kilobytes, and kept inline it would make every request's future (which
/// holds every route's) that large, copied as it is built and moved.
fn within(
    deadline: Duration,
    handler: impl std::future::Future<Output = api::Answer>,
) -> impl std::future::Future<Output = api::Answer> {
    let handler = Box::pin(handler);
    async move {
        let at = std::time::Instant::now() + deadline;
        let timeout = || {
            let mut e = ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout",
                format!("no answer within {} ms; retry", deadline.as_millis()),
            );
            e.retry_after = Some(crate::locks::RETRY_AFTER);
            e
        };
        let bounded = tokio::time::timeout(deadline, handler);
        match crate::task::under_deadline(at, bounded).await {
            Ok(Err(_)) if std::time::Instant::now() >= at => Err(timeout()),
            Ok(answer) => answer,
            Err(_) => Err(timeout()),
        }
    }
}

fn readyz(state: &AppState, locks: &Locks) -> (Response<Full<Bytes>>, &'static str) {
    let body = answers::Readiness::of(&locks.active().router, &state.replica);
    if body.ready {
        (json(StatusCode::OK, &body), "ready")
    } else {
        (json(StatusCode::SERVICE_UNAVAILABLE, &body), "not_ready")
    }
}
