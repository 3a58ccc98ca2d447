//! The router's own HTTP/2 transport to a shard's members, under
//! etcd-client's gRPC calls (through [`Client::from_channel`]).
//!
//! tonic's channel (hyper's HTTP/2 client behind a buffer task) hands a
//! request's body to a task of its own once the headers are queued, so a
//! unary call leaves in two writes (HEADERS, then DATA), with a wake-up of
//! the connection's task for each, and a buffer task between the caller
//! and the connection. Here the caller's own task reads whatever of the
//! body is ready (a unary call's whole message) *before* it opens the
//! stream and queues HEADERS and DATA together: the connection's task
//! writes them in one write. Measured against etcd 3.4.23 (unary Range
//! calls): the client's CPU per call fell from 110 to 59 µs with one caller
//! and from 29.5 to 19.9 µs with 32, and etcd's from 275 to 233 µs and from
//! 89.5 to 80 µs (docs/benchmarks.md).
//!
//! What it keeps of tonic's channel:
//! - **One connection per member**, made on first use and again after it
//!   is lost; a member that cannot be reached is tried again after a
//!   backoff (25 ms, doubling to 1 s), and calls to it meanwhile fail at
//!   once as unavailable, naming the member and the last error.
//! - **HTTP/2 pings** every second whatever the traffic; a connection
//!   whose ping is not answered within a second is dropped, so a silent
//!   member fails its calls and streams within about two seconds, not at
//!   their deadlines.
//! - **TLS** (rustls, ALPN `h2`) with the shard's CA and client
//!   certificate, checked against the endpoint's host.
//! - **Balancing**: a [`Wire`] over all members sends each call to the
//!   next member in rotation ([`Wire::set_serving`]) that is not backing
//!   off; a member's own [`Wire::member`] always uses that member.
//! - **Streams** (keepalives, watches): what the caller has not yet sent
//!   goes through a task that waits for HTTP/2 flow-control capacity
//!   before each message, and stops (resetting the stream) when the answer
//!   is dropped or the peer resets it.
//! - **Errors** as gRPC statuses: anything of the transport is
//!   `Unavailable` (retry later), naming the member.
//!
//! Connections are shared: the balanced wire and each member's own use
//! the same connection to a member.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use etcd_client::{Channel, Client, ConnectOptions};
use h2::client::SendRequest;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Uri, Version};
use http_body::{Body as _, Frame};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tonic::body::Body;
use tonic::Status;
use tower::util::BoxCloneSyncService;

use crate::metrics as m;

/// How often a connection is pinged, and how long its pong may take.
const PING_EVERY: Duration = Duration::from_secs(1);
const PING_TIMEOUT: Duration = Duration::from_secs(1);
/// The wait before a member that could not be reached is tried again,
/// doubling with each failure in a row up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(25);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// HTTP/2 flow-control windows asked of etcd (hyper's defaults): large
/// answers (a page of keys) are not held up by window updates.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A set of members' connections that etcd-client sends its calls on.
#[derive(Clone)]
pub struct Wire {
    links: Arc<[Arc<Link>]>,
    /// A member's own wire: always that member.
    only: Option<usize>,
    /// Round-robin cursor (shared by the clones of one wire).
    next: Arc<AtomicUsize>,
}

/// One member: where it is, how to reach it, and its connection.
struct Link {
    shard: String,
    endpoint: String,
    scheme: Scheme,
    authority: Authority,
    host: String,
    port: u16,
    /// With the server name its certificate must carry.
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    connect_timeout: Duration,
    /// In the balanced wire's rotation.
    serving: AtomicBool,
    state: Mutex<State>,
    /// Held while connecting: one connect per member at a time.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct State {
    /// The live connection's handle, and its number.
    sender: Option<(u64, SendRequest<Bytes>)>,
    /// Numbers the connections, so that a lost one's task does not clear
    /// its successor.
    made: u64,
    /// Connects that failed in a row.
    failures: u32,
    /// Not tried again before this; why the last connect failed.
    retry_at: Option<(Instant, String)>,
}

impl Wire {
    /// A wire over `endpoints` (validated `http://` or `https://` URLs;
    /// `tls` for the latter), every one in rotation. No connection is made
    /// until the first call.
    pub fn new(
        shard: &str,
        endpoints: &[String],
        tls: Option<Arc<rustls::ClientConfig>>,
        connect_timeout: Duration,
    ) -> Result<Self, etcd_client::Error> {
        if endpoints.is_empty() {
            let why = format!("shard {shard}: no endpoints");
            return Err(etcd_client::Error::InvalidArgs(why));
        }
        let links = endpoints
            .iter()
            .map(|ep| Link::new(shard, ep, tls.clone(), connect_timeout).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            links: links.into(),
            only: None,
            next: Arc::default(),
        })
    }

    /// Member `i`'s own wire (its connection is this wire's).
    pub fn member(&self, i: usize) -> Self {
        Self {
            links: self.links.clone(),
            only: Some(i),
            next: Arc::default(),
        }
    }

    /// Takes member `i` out of the rotation of calls without a member of
    /// their own, or puts it back.
    pub fn set_serving(&self, i: usize, serving: bool) {
        if let Some(link) = self.links.get(i) {
            link.serving.store(serving, Ordering::Relaxed);
        }
    }

    /// An etcd client whose calls go out on this wire.
    pub async fn client(&self, options: ConnectOptions) -> Result<Client, etcd_client::Error> {
        let channel = Channel::Custom(BoxCloneSyncService::new(self.clone()));
        Client::from_channel(channel, Some(options)).await
    }

    /// A member in rotation other than `failed` (which could not be
    /// connected to) with a connection, or one made now; `None` for a
    /// member's own wire, or when no other member can be connected to.
    async fn another_connected(
        &self,
        failed: &Arc<Link>,
    ) -> Option<(Arc<Link>, SendRequest<Bytes>)> {
        if self.only.is_some() {
            return None;
        }
        let others = (self.links.iter())
            .filter(|l| !Arc::ptr_eq(l, failed) && l.serving.load(Ordering::Relaxed));
        for link in others.filter(|l| !l.backing_off()) {
            if let Ok(sender) = link.sender().await {
                return Some((link.clone(), sender));
            }
        }
        None
    }

    /// The member the next call goes to: in rotation and not backing off,
    /// taken in turn; else any in rotation (its call fails at once, saying
    /// why), else any.
    fn pick(&self) -> &Arc<Link> {
        if let Some(i) = self.only {
            return &self.links[i];
        }
        let n = self.links.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let turn = || (0..n).map(move |k| &self.links[(start + k) % n]);
        let serving = |l: &&Arc<Link>| l.serving.load(Ordering::Relaxed);
        turn()
            .filter(serving)
            .find(|l| !l.backing_off())
            .or_else(|| turn().find(serving))
            .unwrap_or(&self.links[start % n])
    }
}

impl tower::Service<http::Request<Body>> for Wire {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call waits for its member's connection itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (first, wire) = (self.pick().clone(), self.clone());
        Box::pin(async move {
            let (link, sender) = match first.sender().await {
                Ok(sender) => (first, sender),
                // Not connected, the call was never sent: a balanced call
                // goes to another member instead (one that died a moment
                // ago stays in rotation until the next member probe).
                Err(refused) => match wire.another_connected(&first).await {
                    Some(other) => other,
                    None => return Err(BoxError::from(refused)),
                },
            };
            link.call_on(sender, req).await.map_err(BoxError::from)
        })
    }
}

impl Link {
    fn new(
        shard: &str,
        endpoint: &str,
        tls: Option<Arc<rustls::ClientConfig>>,
        connect_timeout: Duration,
    ) -> Result<Self, etcd_client::Error> {
        let uri: Uri = endpoint.parse()?;
        let bad =
            |why: &str| etcd_client::Error::InvalidArgs(format!("endpoint {endpoint}: {why}"));
        let scheme = uri.scheme().cloned().ok_or_else(|| bad("no scheme"))?;
        let authority = uri.authority().cloned().ok_or_else(|| bad("no host"))?;
        let https = scheme == Scheme::HTTPS;
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        // An IPv6 literal's brackets are the URL's, not the address's.
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let tls = match (https, tls) {
            (false, _) => None,
            (true, None) => return Err(bad("https without TLS settings")),
            (true, Some(config)) => {
                let name = ServerName::try_from(host.clone()).map_err(|e| bad(&e.to_string()))?;
                Some((tokio_rustls::TlsConnector::from(config), name))
            }
        };
        Ok(Self {
            shard: shard.to_string(),
            endpoint: endpoint.to_string(),
            scheme,
            authority,
            host,
            port,
            tls,
            connect_timeout,
            serving: AtomicBool::new(true),
            state: Mutex::default(),
            connecting: tokio::sync::Mutex::new(()),
        })
    }

    fn backing_off(&self) -> bool {
        let state = self.state.lock().expect("link state");
        state.sender.is_none() && matches!(&state.retry_at, Some((at, _)) if Instant::now() < *at)
    }

    fn unavailable(&self, why: impl std::fmt::Display) -> Status {
        Status::unavailable(format!("member {}: {why}", self.endpoint))
    }

    /// One call on `sender`, this member's connection: the body's ready
    /// part read first, then HEADERS and that DATA queued together; the
    /// rest of a stream's body piped after.
    async fn call_on(
        self: Arc<Self>,
        sender: SendRequest<Bytes>,
        req: http::Request<Body>,
    ) -> Result<http::Response<Body>, Status> {
        let (mut parts, mut body) = req.into_parts();
        let (mut ready, mut ended) = (Vec::new(), body.is_end_stream());
        while !ended {
            match poll_once(&mut body) {
                Poll::Ready(Some(Ok(frame))) => {
                    // gRPC requests carry no trailers; anything else is data.
                    if let Ok(data) = frame.into_data() {
                        ready.push(data);
                    }
                }
                Poll::Ready(Some(Err(status))) => return Err(status),
                Poll::Ready(None) => ended = true,
                Poll::Pending => break,
            }
        }
        let mut path = parts.uri.into_parts();
        path.scheme = Some(self.scheme.clone());
        path.authority = Some(self.authority.clone());
        path.path_and_query = path.path_and_query.or(Some(PathAndQuery::from_static("/")));
        parts.uri = Uri::from_parts(path).map_err(|e| Status::internal(e.to_string()))?;
        parts.version = Version::HTTP_2;

        let mut sender = sender.ready().await.map_err(|e| self.broken(e))?;
        let header_only = ended && ready.is_empty();
        let (answer, mut send) = sender
            .send_request(http::Request::from_parts(parts, ()), header_only)
            .map_err(|e| self.broken(e))?;
        let last = ready.len();
        for (i, data) in ready.into_iter().enumerate() {
            send.send_data(data, ended && i + 1 == last)
                .map_err(|e| self.broken(e))?;
        }
        // Dropped with the answer (or with this call, before it): the
        // pipe then stops and resets the stream.
        let (answer_alive, answer_dropped) = oneshot::channel::<()>();
        if !ended {
            tokio::spawn(pipe(body, send, answer_dropped));
        }
        let answer = answer.await.map_err(|e| self.broken(e))?;
        Ok(answer.map(|recv| {
            Body::new(Incoming {
                recv,
                data_done: false,
                link: self.clone(),
                _alive: answer_alive,
            })
        }))
    }

    /// The member's connection, made if there is none (and the member is
    /// not backing off).
    async fn sender(self: &Arc<Self>) -> Result<SendRequest<Bytes>, Status> {
        if let Some(s) = self.live() {
            return Ok(s);
        }
        let _one = self.connecting.lock().await;
        if let Some(s) = self.live() {
            return Ok(s);
        }
        if let Some((at, why)) = &self.state.lock().expect("link state").retry_at {
            let left = at.saturating_duration_since(Instant::now());
            if !left.is_zero() {
                return Err(
                    self.unavailable(format!("{why} (tried again in {} ms)", left.as_millis()))
                );
            }
        }
        let connected = tokio::time::timeout(self.connect_timeout, self.connect()).await;
        let outcome = match connected {
            Ok(Ok(sender)) => Ok(sender),
            Ok(Err(why)) => Err(why),
            Err(_) => Err(format!(
                "no connection within {} ms",
                self.connect_timeout.as_millis()
            )),
        };
        let mut state = self.state.lock().expect("link state");
        match outcome {
            Ok(sender) => Ok(sender),
            Err(why) => {
                state.failures = state.failures.saturating_add(1);
                let wait = BACKOFF_MIN
                    .saturating_mul(1u32 << (state.failures - 1).min(10))
                    .min(BACKOFF_MAX);
                state.retry_at = Some((Instant::now() + wait, why.clone()));
                m::etcd_connection(&self.shard, &self.endpoint, "failed");
                tracing::debug!(shard = %self.shard, member = %self.endpoint, error = %why, "cannot connect to member");
                Err(self.unavailable(why))
            }
        }
    }

    fn live(&self) -> Option<SendRequest<Bytes>> {
        let state = self.state.lock().expect("link state");
        state.sender.as_ref().map(|(_, s)| s.clone())
    }

    /// Connects (TCP, TLS if the endpoint is `https://`, the HTTP/2
    /// handshake) and starts the connection's task.
    async fn connect(self: &Arc<Self>) -> Result<SendRequest<Bytes>, String> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| e.to_string())?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        match &self.tls {
            None => self.handshake(tcp).await,
            Some((tls, name)) => {
                let stream = tls
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| format!("TLS: {e}"))?;
                self.handshake(stream).await
            }
        }
    }

    async fn handshake<T>(self: &Arc<Self>, io: T) -> Result<SendRequest<Bytes>, String>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, mut conn) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .enable_push(false)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(|e| format!("HTTP/2: {e}"))?;
        let number = {
            let mut state = self.state.lock().expect("link state");
            state.made += 1;
            state.failures = 0;
            state.retry_at = None;
            state.sender = Some((state.made, sender.clone()));
            state.made
        };
        m::etcd_connection(&self.shard, &self.endpoint, "made");
        let pings = conn.ping_pong().map(keep_pinging);
        let link = Arc::downgrade(self);
        tokio::spawn(async move {
            let why = match pings {
                Some(pings) => tokio::select! {
                    done = &mut conn => done.err().map(|e| e.to_string()),
                    why = pings => Some(why),
                },
                None => conn.await.err().map(|e| e.to_string()),
            };
            Link::lost(&link, number, why);
        });
        Ok(sender)
    }

    /// Connection `number` ended (`why`, if not closed cleanly): the next
    /// call makes a new one.
    fn lost(link: &Weak<Self>, number: u64, why: Option<String>) {
        let Some(link) = link.upgrade() else { return };
        let mut state = link.state.lock().expect("link state");
        if matches!(&state.sender, Some((n, _)) if *n == number) {
            state.sender = None;
            m::etcd_connection(&link.shard, &link.endpoint, "lost");
            tracing::debug!(shard = %link.shard, member = %link.endpoint, error = ?why, "connection to member ended");
        }
    }

    /// An HTTP/2 error of a call as its gRPC status.
    fn broken(&self, e: h2::Error) -> Status {
        match e.reason() {
            Some(h2::Reason::CANCEL) => Status::cancelled(format!("member {}: {e}", self.endpoint)),
            _ => self.unavailable(e),
        }
    }
}

/// Pings until a pong is late or the connection is gone; says why.
async fn keep_pinging(mut pings: h2::PingPong) -> String {
    loop {
        tokio::time::sleep(PING_EVERY).await;
        match tokio::time::timeout(PING_TIMEOUT, pings.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return e.to_string(),
            Err(_) => return format!("no ping answer within {} ms", PING_TIMEOUT.as_millis()),
        }
    }
}

/// Polls `body` once, from the calling task.
fn poll_once(body: &mut Body) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
    let waker = futures::task::noop_waker();
    Pin::new(body).poll_frame(&mut Context::from_waker(&waker))
}

/// Sends a stream's body as it comes, each message when HTTP/2 flow
/// control lets it; stops when the body ends, the answer is dropped, or
/// the peer resets the stream.
async fn pipe(
    mut body: Body,
    mut send: h2::SendStream<Bytes>,
    answer_dropped: oneshot::Receiver<()>,
) {
    let mut answer_dropped = answer_dropped;
    loop {
        let frame = tokio::select! {
            frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)) => frame,
            _ = &mut answer_dropped => return send.send_reset(h2::Reason::CANCEL),
            _ = std::future::poll_fn(|cx| send.poll_reset(cx)) => return,
        };
        match frame {
            None => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Some(Ok(frame)) => {
                let Ok(mut data) = frame.into_data() else {
                    continue;
                };
                while !data.is_empty() {
                    send.reserve_capacity(data.len());
                    let granted = tokio::select! {
                        c = std::future::poll_fn(|cx| send.poll_capacity(cx)) => c,
                        _ = &mut answer_dropped => return send.send_reset(h2::Reason::CANCEL),
                    };
                    match granted {
                        Some(Ok(n)) if n > 0 => {
                            let chunk = data.split_to(n.min(data.len()));
                            if send.send_data(chunk, false).is_err() {
                                return;
                            }
                        }
                        Some(Ok(_)) => {}
                        Some(Err(_)) | None => return,
                    }
                }
            }
            Some(Err(_)) => return send.send_reset(h2::Reason::CANCEL),
        }
    }
}

/// An answer's body: its DATA (each read frees its flow-control window
/// at once), then its trailers (gRPC's status).
struct Incoming {
    recv: h2::RecvStream,
    data_done: bool,
    link: Arc<Link>,
    /// Dropped with the body: tells the request's pipe to stop.
    _alive: oneshot::Sender<()>,
}

impl http_body::Body for Incoming {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if !this.data_done {
            match std::task::ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(this.link.broken(e)))),
                None => this.data_done = true,
            }
        }
        match std::task::ready!(this.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(this.link.broken(e)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSlice;

    /// The endpoint of a link these tests handshake over an in-memory pipe:
    /// a name in the reserved `.invalid` domain, so nothing is ever dialled.
    const IN_MEMORY: &str = "http://in-memory.invalid:2379";

    /// One side of an in-memory connection that keeps each write's bytes.
    struct Recording {
        io: tokio::io::DuplexStream,
        writes: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    impl AsyncRead for Recording {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Recording {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.poll_write_vectored(cx, &[IoSlice::new(buf)])
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let all: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            let n = std::task::ready!(Pin::new(&mut self.io).poll_write(cx, &all))?;
            self.writes.lock().unwrap().push(all[..n].to_vec());
            Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    /// The (type, stream, flags) of each HTTP/2 frame in one write.
    fn frames(mut write: &[u8]) -> Vec<(u8, u32, u8)> {
        const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        write = write.strip_prefix(PREFACE).unwrap_or(write);
        let mut found = Vec::new();
        while write.len() >= 9 {
            let len = u32::from_be_bytes([0, write[0], write[1], write[2]]) as usize;
            let stream = u32::from_be_bytes([write[5], write[6], write[7], write[8]]) & 0x7fff_ffff;
            found.push((write[3], stream, write[4]));
            write = &write[(9 + len).min(write.len())..];
        }
        found
    }

    /// A server that answers every request with one gRPC message and an
    /// OK status.
    async fn serve(io: tokio::io::DuplexStream) {
        let mut conn = h2::server::handshake(io).await.unwrap();
        while let Some(Ok((req, mut respond))) = conn.accept().await {
            tokio::spawn(async move {
                let mut body = req.into_body();
                while let Some(Ok(_)) = body.data().await {}
                let answer = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(())
                    .unwrap();
                let mut send = respond.send_response(answer, false).unwrap();
                send.send_data(Bytes::from_static(b"\0\0\0\0\x02ok"), false)
                    .unwrap();
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", "0".parse().unwrap());
                send.send_trailers(trailers).unwrap();
            });
        }
    }

    /// One call on `link`, connecting first if it must.
    async fn call(
        link: Arc<Link>,
        req: http::Request<Body>,
    ) -> Result<http::Response<Body>, Status> {
        let sender = link.sender().await?;
        link.call_on(sender, req).await
    }

    fn unary_call() -> http::Request<Body> {
        let message = http_body_util::Full::new(Bytes::from_static(b"\0\0\0\0\x05hello"));
        http::Request::builder()
            .method("POST")
            .uri("/etcdserverpb.KV/Range")
            .header("content-type", "application/grpc")
            .body(Body::new(message))
            .unwrap()
    }

    #[tokio::test]
    async fn a_unary_call_leaves_in_one_write() {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        tokio::spawn(serve(server_io));
        let writes = Arc::new(Mutex::new(Vec::new()));
        let link = Arc::new(Link::new("a", IN_MEMORY, None, PING_EVERY).unwrap());
        let io = Recording {
            io: client_io,
            writes: writes.clone(),
        };
        link.handshake(io).await.unwrap();
        for _ in 0..3 {
            let answer = call(link.clone(), unary_call()).await.unwrap();
            let mut body = answer.into_body();
            let mut got = Vec::new();
            while let Some(frame) =
                std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
            {
                got.push(frame.unwrap());
            }
            assert_eq!(got[0].data_ref().unwrap().as_ref(), b"\0\0\0\0\x02ok");
            assert_eq!(got[1].trailers_ref().unwrap()["grpc-status"], "0");
        }
        let writes = writes.lock().unwrap();
        let (headers, data, end_stream) = (0x1, 0x0, 0x1);
        for stream in [1, 3, 5] {
            let together = writes.iter().map(|w| frames(w)).any(|f| {
                f.iter().any(|&(t, s, _)| t == headers && s == stream)
                    && f.iter()
                        .any(|&(t, s, flags)| t == data && s == stream && flags & end_stream != 0)
            });
            assert!(
                together,
                "stream {stream}'s HEADERS and DATA in separate writes: {writes:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_streams_later_messages_go_out_and_dropping_its_answer_resets_it() {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut conn = h2::server::handshake(server_io).await.unwrap();
            let (req, mut respond) = conn.accept().await.unwrap().unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let answer = http::Response::builder().body(()).unwrap();
            let _send = respond.send_response(answer, false).unwrap();
            let mut body = req.into_body();
            loop {
                let got = body.data().await;
                let end = !matches!(got, Some(Ok(_)));
                seen_tx
                    .send(got.map(|r| r.map_err(|e| e.reason())))
                    .unwrap();
                if end {
                    return;
                }
            }
        });
        let link = Arc::new(Link::new("a", IN_MEMORY, None, PING_EVERY).unwrap());
        link.handshake(client_io).await.unwrap();
        let (messages, rx) = futures::channel::mpsc::unbounded::<Result<Frame<Bytes>, Status>>();
        let body = Body::new(http_body_util::StreamBody::new(rx));
        let mut req = unary_call();
        *req.body_mut() = body;
        let answer = call(link.clone(), req).await.unwrap();
        for message in [&b"one"[..], b"two"] {
            messages
                .unbounded_send(Ok(Frame::data(Bytes::from_static(message))))
                .unwrap();
            let got = seen.recv().await.unwrap().unwrap().unwrap();
            assert_eq!(got.as_ref(), message);
        }
        // The caller gives up on the answer while its request stream is
        // still open: the pipe resets the stream and lets go of the body.
        drop(answer);
        let last = seen.recv().await.unwrap();
        assert!(
            matches!(last, Some(Err(Some(h2::Reason::CANCEL)))),
            "{last:?}"
        );
        assert!(messages.is_closed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_whose_pings_go_unanswered_is_dropped() {
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        // The server reads the preface, then never again: a paused member.
        tokio::spawn(async move {
            let _conn = h2::server::handshake(server_io).await.unwrap();
            std::future::pending::<()>().await;
        });
        let link = Arc::new(Link::new("a", IN_MEMORY, None, PING_EVERY).unwrap());
        link.handshake(client_io).await.unwrap();
        assert!(link.live().is_some());
        tokio::time::sleep(PING_EVERY + PING_TIMEOUT / 2).await;
        assert!(link.live().is_some(), "dropped before its ping was late");
        tokio::time::sleep(PING_TIMEOUT).await;
        assert!(link.live().is_none(), "kept after its ping went unanswered");
    }

    #[tokio::test]
    async fn a_member_that_cannot_be_reached_is_not_tried_again_at_once() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let endpoint = format!("http://127.0.0.1:{port}");
        let link = Arc::new(Link::new("a", &endpoint, None, PING_EVERY).unwrap());
        let first = call(link.clone(), unary_call()).await.unwrap_err();
        assert_eq!(first.code(), tonic::Code::Unavailable);
        assert!(first.message().contains(&endpoint), "{first:?}");
        assert!(link.backing_off());
        let again = call(link.clone(), unary_call()).await.unwrap_err();
        assert_eq!(again.code(), tonic::Code::Unavailable);
        assert!(again.message().contains("tried again in"), "{again:?}");
        // Past the backoff it is tried again (and fails again, for longer).
        tokio::time::sleep(BACKOFF_MIN * 2).await;
        assert!(!link.backing_off());
        let third = call(link.clone(), unary_call()).await.unwrap_err();
        assert!(!third.message().contains("tried again in"), "{third:?}");
        assert_eq!(link.state.lock().unwrap().failures, 2);
    }

    /// A balanced call whose member cannot be connected to was never
    /// sent, and goes to another member (before the member probes take a
    /// dead member out of rotation, every other call went to it and
    /// failed); a call on a member's own wire does not.
    #[tokio::test]
    async fn a_balanced_call_a_dead_member_cannot_take_goes_to_another() {
        let dead = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let endpoints = [format!("http://127.0.0.1:{dead}"), IN_MEMORY.to_string()];
        let mut wire = Wire::new("a", &endpoints, None, PING_EVERY).unwrap();
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        tokio::spawn(serve(server_io));
        wire.links[1].handshake(client_io).await.unwrap();
        for round in 0..4 {
            let answer = tower::Service::call(&mut wire, unary_call()).await;
            assert!(answer.is_ok(), "round {round}: {:?}", answer.err());
            // Past the dead member's backoff, the rotation picks it again.
            tokio::time::sleep(BACKOFF_MIN * 2).await;
        }
        assert!(wire.links[0].state.lock().unwrap().failures >= 1);
        let mut own = wire.member(0);
        assert!(tower::Service::call(&mut own, unary_call()).await.is_err());
    }

    #[test]
    fn endpoints_are_read_into_scheme_host_and_port() {
        let link = Link::new("a", "http://[::1]:2379", None, PING_EVERY).unwrap();
        assert_eq!((link.host.as_str(), link.port), ("::1", 2379));
        let link = Link::new("a", "http://etcd-0", None, PING_EVERY).unwrap();
        assert_eq!((link.host.as_str(), link.port), ("etcd-0", 80));
        // https needs the shard's TLS settings.
        assert!(Link::new("a", "https://etcd-0:2379", None, PING_EVERY).is_err());
        assert!(Link::new("a", "etcd-0:2379", None, PING_EVERY).is_err());
    }
}
