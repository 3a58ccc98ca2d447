//! Loopback plumbing: free ports, and a tiny blocking HTTP/1.0 client for
//! etcd's `/health` and `/metrics` and the router's `/readyz`, `/metrics`
//! and admin routes, so the kit needs no runtime to start or watch a
//! process. Every address is 127.0.0.1, or an etcd member's address inside
//! a test's own network namespace ([`netns`](crate::netns)).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// How long a call waits for its whole answer.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    try_free_port().expect("bind a free loopback port")
}

/// Ports are picked below the kernel's ephemeral range, so that nothing
/// that binds port 0 or connects out (routers, proxies, clients) can take
/// one between this pick and the bind of the process it is for. Picks go
/// round a window from a random start; a port that is taken is skipped.
pub(crate) fn try_free_port() -> io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let Some((low, size)) = below_ephemeral() else {
        return Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
    };
    if NEXT.load(Ordering::Relaxed) == u32::MAX {
        let seed = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            std::process::id(),
        );
        let _ = NEXT.compare_exchange(
            u32::MAX,
            (seed % u64::from(size)) as u32,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
    for _ in 0..size {
        let port = low + (NEXT.fetch_add(1, Ordering::Relaxed) % size) as u16;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            return Ok(l.local_addr()?.port());
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `(first port, count)` of a window of up to 20,000 ports just below the
/// ephemeral range and above 1023, or `None` if there is no room.
fn below_ephemeral() -> Option<(u16, u32)> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let first: u32 = range.split_whitespace().next()?.parse().ok()?;
    let low = first.saturating_sub(20_000).max(1024);
    let size = first.checked_sub(low).filter(|&n| n >= 1_000)?;
    Some((u16::try_from(low).ok()?, size))
}

/// A status code and the body as text.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Text: health, readiness, Prometheus text and admin JSON all are.
    pub body: String,
}

/// `GET path` on `port`, answered within [`ANSWER_WITHIN`].
pub fn get(port: u16, path: &str) -> io::Result<Response> {
    request(port, "GET", path, ANSWER_WITHIN)
}

/// `POST path` on `port` with an empty JSON body, answered within
/// [`ANSWER_WITHIN`].
pub fn post(port: u16, path: &str) -> io::Result<Response> {
    request(port, "POST", path, ANSWER_WITHIN)
}

/// One HTTP/1.0 request with no body; the server closes the connection
/// after its answer, which ends the read.
pub fn request(port: u16, method: &str, path: &str, within: Duration) -> io::Result<Response> {
    request_at(
        SocketAddr::from(([127, 0, 0, 1], port)),
        method,
        path,
        within,
    )
}

/// [`request`] to `addr`, which connects within `within` too.
pub fn request_at(
    addr: SocketAddr,
    method: &str,
    path: &str,
    within: Duration,
) -> io::Result<Response> {
    let mut s = TcpStream::connect_timeout(&addr, within)?;
    s.set_read_timeout(Some(within))?;
    // Admin POSTs take an empty body only as JSON (a web page's form
    // cannot send that type).
    let typed = if method == "POST" {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {}\r\n{typed}Content-Length: 0\r\n\r\n",
        addr.ip()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed status line"))?;
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok(Response { status, body })
}
