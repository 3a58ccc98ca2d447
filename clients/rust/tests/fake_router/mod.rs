//! A scripted stand-in for the router's v1 API on a loopback port, for
//! what a real router cannot be made to do on cue: answer a release with
//! 503 a given number of times, and count exactly which requests arrived.
//!
//! It grants every acquire (the same lockId and token for a name, as the
//! router does for a client that already holds it, until a release of that
//! grant is answered 204: then a new lockId and a larger token), renews
//! every lock, and
//! answers releases from a script (204 once the script is used up, unless
//! it is set to fail for ever, or to leave them unanswered as a router
//! that cannot be reached would), and gives its error answers a
//! `Retry-After` when told to. Plain HTTP/1.1 with keep-alive, enough for
//! the client's pooled connections.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// One request as the fake saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub body: Value,
    /// When it arrived.
    pub at: Instant,
}

#[derive(Default)]
struct State {
    /// Status codes for the next releases, in order.
    releases: VecDeque<u16>,
    /// Answer every release beyond the script with 503.
    releases_fail: bool,
    /// Answer no release at all (the request is read and seen, then left
    /// hanging until the client gives up on it).
    releases_unanswered: bool,
    /// The `Retry-After` value sent with every error answer, if any.
    retry_after: Option<String>,
    /// lockId → ttlMs, from the acquires.
    ttls: HashMap<String, u64>,
    /// Grants released with a 204, and how many times each name was
    /// granted anew after such a release.
    released: HashSet<String>,
    generation: HashMap<String, u64>,
    seen: Vec<Seen>,
}

/// The fake router; it stops serving when dropped.
pub struct FakeRouter {
    pub base: String,
    state: Arc<Mutex<State>>,
    server: JoinHandle<()>,
}

impl FakeRouter {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let server = {
            let state = state.clone();
            tokio::spawn(async move {
                // Aborted with the server, so no connection outlives it.
                let mut conns = JoinSet::new();
                while let Ok((stream, _)) = listener.accept().await {
                    conns.spawn(serve(stream, state.clone()));
                }
            })
        };
        Self {
            base: format!("http://{addr}"),
            state,
            server,
        }
    }

    /// The next releases are answered with these statuses.
    pub fn script_releases(&self, statuses: &[u16]) {
        self.state.lock().unwrap().releases.extend(statuses);
    }

    /// Every release is answered 503 from now on.
    pub fn fail_releases(&self) {
        self.state.lock().unwrap().releases_fail = true;
    }

    /// Every release is left unanswered from now on, as by a router that
    /// cannot be reached: the client's request timeout ends each attempt.
    pub fn black_hole_releases(&self) {
        self.state.lock().unwrap().releases_unanswered = true;
    }

    /// Releases are answered 204 again (after [`fail_releases`](Self::fail_releases)
    /// or [`black_hole_releases`](Self::black_hole_releases)).
    pub fn heal_releases(&self) {
        let mut state = self.state.lock().unwrap();
        state.releases_fail = false;
        state.releases_unanswered = false;
    }

    /// Error answers from now on carry `Retry-After: <value>`.
    pub fn retry_after_on_errors(&self, value: &str) {
        self.state.lock().unwrap().retry_after = Some(value.to_string());
    }

    /// The operations (`acquire`, `release`, ...) seen so far, in order.
    pub fn ops(&self) -> Vec<String> {
        let state = self.state.lock().unwrap();
        state
            .seen
            .iter()
            .map(|s| s.path.trim_start_matches("/api/v1/locks/").to_string())
            .collect()
    }

    /// Requests seen so far on `path` (`/api/v1/locks/<op>`).
    pub fn seen(&self, op: &str) -> Vec<Seen> {
        let path = format!("/api/v1/locks/{op}");
        let state = self.state.lock().unwrap();
        state
            .seen
            .iter()
            .filter(|s| s.path == path)
            .cloned()
            .collect()
    }
}

impl Drop for FakeRouter {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn serve(stream: TcpStream, state: Arc<Mutex<State>>) {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    loop {
        let mut path = String::new();
        let mut length = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if path.is_empty() {
                path = l.split(' ').nth(1).unwrap_or_default().to_string();
            } else if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        if read.read_exact(&mut body).await.is_err() {
            return;
        }
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let Some((status, answer)) = answer(&state, &path, &body) else {
            // Unanswered: read on until the client gives up and closes.
            let _ = tokio::io::copy(&mut read, &mut tokio::io::sink()).await;
            return;
        };
        let text = answer.map(|a| a.to_string()).unwrap_or_default();
        let retry_after = match state.lock().unwrap().retry_after.clone() {
            Some(value) if status >= 400 => format!("retry-after: {value}\r\n"),
            _ => String::new(),
        };
        let head = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{retry_after}content-length: {}\r\n\r\n",
            text.len()
        );
        if write
            .write_all(format!("{head}{text}").as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// The status and body to answer with; `None`: no answer at all.
fn answer(state: &Mutex<State>, path: &str, body: &Value) -> Option<(u16, Option<Value>)> {
    let mut s = state.lock().unwrap();
    s.seen.push(Seen {
        path: path.to_string(),
        body: body.clone(),
        at: Instant::now(),
    });
    let renewed = |s: &State, id: &Value| {
        let ms = id.as_str().and_then(|id| s.ttls.get(id)).copied();
        json!({"lockId": id, "renewed": true, "expiresInMs": ms.unwrap_or(2_000)})
    };
    Some(match path.trim_start_matches("/api/v1/locks/") {
        "acquire" => {
            let name = body["name"].as_str().unwrap_or_default();
            let ttl = body["ttlMs"].as_u64().unwrap_or(2_000);
            let grant_id = |g: u64| match g {
                0 => format!("id-{name}"),
                g => format!("id-{name}-{g}"),
            };
            let mut g = s.generation.get(name).copied().unwrap_or(0);
            if s.released.contains(&grant_id(g)) {
                g += 1;
                s.generation.insert(name.to_string(), g);
            }
            let id = grant_id(g);
            s.ttls.insert(id.clone(), ttl);
            let grant = json!({"acquired": true, "lockId": id, "fencingToken": 7 + g,
                "expiresAt": "2030-01-01T00:00:00.000Z", "expiresInMs": ttl});
            (200, Some(grant))
        }
        "renew" => (200, Some(renewed(&s, &body["lockId"]))),
        "renew-batch" => {
            let locks = body["locks"].as_array().cloned().unwrap_or_default();
            let results: Vec<Value> = locks.iter().map(|l| renewed(&s, &l["lockId"])).collect();
            (200, Some(json!({ "results": results })))
        }
        "release" if s.releases_unanswered => return None,
        "release" => match s.releases.pop_front() {
            Some(204) => released(&mut s, &body["lockId"]),
            None if !s.releases_fail => released(&mut s, &body["lockId"]),
            Some(status) => (status, Some(error(status))),
            None => (503, Some(error(503))),
        },
        _ => (404, Some(error(404))),
    })
}

/// A release answered 204: the next acquire of its name is a new grant.
fn released(s: &mut State, id: &Value) -> (u16, Option<Value>) {
    if let Some(id) = id.as_str() {
        s.released.insert(id.to_string());
    }
    (204, None)
}

fn error(status: u16) -> Value {
    let code = match status {
        400 => "invalid_argument",
        404 => "not_found",
        503 => "shard_unavailable",
        _ => "internal",
    };
    json!({"error": {"code": code, "message": format!("scripted {status}")}})
}
