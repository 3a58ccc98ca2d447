//! The router's v1 API as goose users call it: every call goes through
//! goose (so it is throttled when the scenario is, and shows in goose's
//! report) and is also counted in the scenario's [`Stats`].

use std::time::{Duration, Instant};

use bytes::Bytes;
use goose::prelude::*;
use serde_json::{json, Value};

use crate::stats::Stats;

/// A lock the load generator holds.
#[derive(Debug, Clone)]
pub struct Held {
    pub lock_id: String,
    pub token: u64,
}

/// What an acquire call came to.
pub enum Acquire {
    Granted(Held),
    /// Someone else holds the name.
    Held,
    Failed,
}

/// Takes a token from goose's throttle, as a goose request would; false
/// once the attack has ended and the throttle is closed.
pub async fn throttle(user: &GooseUser) -> bool {
    match (&user.throttle, user.is_throttled) {
        (Some(t), true) => t.send_async(true).await.is_ok(),
        _ => true,
    }
}

/// POSTs `body` to `path`; returns the status, the JSON body (Null when
/// empty) and how long the call took, or None after counting a transport
/// error or an unreadable body. The throttle token is taken first, so the
/// time is the request's own, not its wait for a slot.
pub async fn post(
    user: &mut GooseUser,
    stats: &Stats,
    path: &str,
    body: &Value,
) -> Option<(u16, Value, Duration)> {
    let (status, text, took) = post_text(user, stats, path, body).await?;
    if text.is_empty() {
        return Some((status, Value::Null, took));
    }
    match serde_json::from_str(&text) {
        Ok(v) => Some((status, v, took)),
        Err(_) => {
            stats.error();
            None
        }
    }
}

/// [`post`] of any serializable body, returning the response text: for
/// calls hot enough that building and parsing `Value` trees would cost
/// the load generator more than the router.
pub async fn post_text<T: serde::Serialize + ?Sized>(
    user: &mut GooseUser,
    stats: &Stats,
    path: &str,
    body: &T,
) -> Option<(u16, String, Duration)> {
    post_bytes(user, stats, path, json_body(body)).await
}

/// [`post_text`] of a body already written as JSON.
async fn post_bytes(
    user: &mut GooseUser,
    stats: &Stats,
    path: &str,
    body: Bytes,
) -> Option<(u16, String, Duration)> {
    let a = send_bytes(user, stats, path, body).await?;
    stats.status(a.status);
    if a.status >= 500 {
        stats.server_error(a.status, &a.text);
    }
    Some((a.status, a.text, a.took))
}

/// `body` written as JSON, as reqwest's `json` would send it.
fn json_body<T: serde::Serialize + ?Sized>(body: &T) -> Bytes {
    // The load generator's own request types and `Value`s: nothing in them
    // can fail to serialise (no map has keys that are not strings).
    serde_json::to_vec(body)
        .expect("request bodies serialise")
        .into()
}

/// An answer as [`send`] returns it.
pub struct Answer {
    pub status: u16,
    /// The `Retry-After` header, if any.
    pub retry_after: Option<String>,
    pub text: String,
    pub took: Duration,
}

/// [`post_text`] without counting the status (the caller classifies it:
/// `overload` tells 503 refusals from other 5xx), keeping `Retry-After`.
pub async fn send<T: serde::Serialize + ?Sized>(
    user: &mut GooseUser,
    stats: &Stats,
    path: &str,
    body: &T,
) -> Option<Answer> {
    send_bytes(user, stats, path, json_body(body)).await
}

/// [`send`] of a body already written as JSON.
async fn send_bytes(
    user: &mut GooseUser,
    stats: &Stats,
    path: &str,
    body: Bytes,
) -> Option<Answer> {
    if !throttle(user).await {
        // The attack ended while this user waited: nothing was sent.
        return None;
    }
    let throttled = std::mem::replace(&mut user.is_throttled, false);
    let flight = stats.sending();
    let started = Instant::now();
    // goose's `post_json` as it is, but with the URL parsed once per path
    // instead of three times per request, and the body written by the
    // caller (a renew-batch's, once per client).
    let sent = match url(&user.base_url, path) {
        Some(url) => {
            let builder = user
                .client
                .post(url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body);
            let request = GooseRequest::builder()
                .method(GooseMethod::Post)
                .path(path)
                .set_request_builder(builder)
                .build();
            Some(user.request(request).await)
        }
        None => None,
    };
    user.is_throttled = throttled;
    stats.request();
    let Some(Ok(goose)) = sent else {
        stats.error();
        return None;
    };
    let resp = match goose.response {
        Ok(r) => r,
        Err(_) => {
            stats.error();
            return None;
        }
    };
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // The router answers UTF-8 JSON: checked as such, not decoded as any
    // charset a header might name (reqwest's `text` went through a lossy
    // decoder, a few percent of the load generator in `hold`).
    let text = match resp.bytes().await.map(|b| String::from_utf8(b.into())) {
        Ok(Ok(t)) => t,
        _ => {
            stats.status(status);
            stats.error();
            return None;
        }
    };
    let took = started.elapsed();
    drop(flight);
    Some(Answer {
        status,
        retry_after,
        text,
        took,
    })
}

/// `path` under `base`, parsed once per thread and path: a request's URL
/// cost the load generator three parses (goose's two and reqwest's), a few
/// percent of its CPU. None when `path` does not join onto `base`.
fn url(base: &reqwest::Url, path: &str) -> Option<reqwest::Url> {
    thread_local! {
        static URLS: std::cell::RefCell<Vec<(reqwest::Url, String, reqwest::Url)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    URLS.with_borrow_mut(|urls| {
        if let Some((_, _, url)) = urls.iter().find(|(b, p, _)| b == base && p == path) {
            return Some(url.clone());
        }
        let url = base.join(path).ok()?;
        urls.push((base.clone(), path.to_string(), url.clone()));
        Some(url)
    })
}

/// Acquires `name` for `client`, recording the acquire's latency.
pub async fn acquire(
    user: &mut GooseUser,
    stats: &Stats,
    name: &str,
    client: &str,
    ttl_ms: u64,
) -> Acquire {
    acquire_waiting(user, stats, name, client, ttl_ms, 0).await
}

/// [`acquire`] that waits up to `wait_ms` in the name's queue (0: does not
/// wait); the latency recorded includes the wait.
pub async fn acquire_waiting(
    user: &mut GooseUser,
    stats: &Stats,
    name: &str,
    client: &str,
    ttl_ms: u64,
    wait_ms: u64,
) -> Acquire {
    let mut body = json!({"name": name, "ttlMs": ttl_ms, "clientId": client});
    if wait_ms > 0 {
        body["waitMs"] = json!(wait_ms);
    }
    let Some((status, v, took)) = post(user, stats, "/api/v1/locks/acquire", &body).await else {
        return Acquire::Failed;
    };
    if status != 200 {
        stats.error();
        return Acquire::Failed;
    }
    if v["acquired"] == true {
        match (v["lockId"].as_str(), v["fencingToken"].as_u64()) {
            (Some(id), Some(token)) => {
                stats.granted(user.weighted_users_index, took);
                Acquire::Granted(Held {
                    lock_id: id.to_string(),
                    token,
                })
            }
            _ => {
                stats.error();
                Acquire::Failed
            }
        }
    } else if v["acquired"] == false {
        stats.refused(took);
        Acquire::Held
    } else {
        stats.error();
        Acquire::Failed
    }
}

/// Releases `lock`; a 204 is the only success.
pub async fn release(user: &mut GooseUser, stats: &Stats, lock: &Held) {
    let body = json!({"lockId": lock.lock_id, "fencingToken": lock.token});
    match post(user, stats, "/api/v1/locks/release", &body).await {
        Some((204, _, _)) => stats.released_one(),
        Some(_) => stats.error(),
        None => {}
    }
}

/// Renews one lock with its own call; false if it is gone.
pub async fn renew(user: &mut GooseUser, stats: &Stats, lock: &Held) -> bool {
    let body = json!({"lockId": lock.lock_id, "fencingToken": lock.token});
    match post(user, stats, "/api/v1/locks/renew", &body).await {
        Some((200, v, _)) if v["renewed"] == true => {
            stats
                .renewed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            true
        }
        Some((409, v, _)) => {
            stats.lose(v["reason"].as_str().unwrap_or("unknown"));
            stats.error();
            false
        }
        Some(_) => {
            stats.error();
            false
        }
        None => false,
    }
}

/// The bodies of one client's renew-batch calls, kept between its
/// renewals: a client renews the same locks every period, and writing
/// their lockIds as JSON again each time took a fifth of the load
/// generator's CPU in `hold` (serde checks every byte of a string for
/// characters to escape). Locks are only ever added to a client's list
/// (a lost lock stays in it), so a body is written again only when the
/// number of locks in its chunk changes.
#[derive(Debug, Default)]
pub struct RenewBodies {
    /// One body per chunk of the list, with the number of locks it carries.
    chunks: Vec<(usize, Bytes)>,
    /// The chunks' size: another size groups the list anew.
    max_batch: usize,
}

impl RenewBodies {
    /// The bodies for `locks` in chunks of `max_batch`, each with its
    /// number of locks; `locks` must extend the list of the last call.
    fn update(&mut self, locks: &[Held], max_batch: usize) -> &[(usize, Bytes)] {
        #[derive(serde::Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Item<'a> {
            lock_id: &'a str,
            fencing_token: u64,
        }
        #[derive(serde::Serialize)]
        struct Body<'a> {
            locks: Vec<Item<'a>>,
        }
        let max_batch = max_batch.max(1);
        if max_batch != self.max_batch {
            self.chunks.clear();
            self.max_batch = max_batch;
        }
        let chunks = locks.chunks(max_batch);
        let count = chunks.len();
        for (k, chunk) in chunks.enumerate() {
            if self.chunks.get(k).is_some_and(|(n, _)| *n == chunk.len()) {
                continue;
            }
            let body = json_body(&Body {
                locks: chunk
                    .iter()
                    .map(|l| Item {
                        lock_id: &l.lock_id,
                        fencing_token: l.token,
                    })
                    .collect(),
            });
            match self.chunks.get_mut(k) {
                Some(slot) => *slot = (chunk.len(), body),
                None => self.chunks.push((chunk.len(), body)),
            }
        }
        self.chunks.truncate(count);
        &self.chunks
    }
}

/// Renews `locks` in calls of at most `max_batch`, their bodies kept in
/// `bodies` from one renewal to the next; returns how many were not
/// renewed for now and are worth retrying at once, as the SDKs do (a
/// request that failed or timed out, a 5xx, an entry answered
/// `shard_unavailable`). A lock answered `expired` or `stolen` is lost.
pub async fn renew_batch(
    user: &mut GooseUser,
    stats: &Stats,
    locks: &[Held],
    bodies: &mut RenewBodies,
    max_batch: usize,
) -> usize {
    /// Only what is checked; the rest of each entry is skipped unread.
    #[derive(serde::Deserialize)]
    struct Answer {
        results: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        renewed: bool,
        reason: Option<String>,
    }
    let mut retry = 0;
    for (n, body) in bodies.update(locks, max_batch) {
        let path = "/api/v1/locks/renew-batch";
        let Some((status, text, _)) = post_bytes(user, stats, path, body.clone()).await else {
            retry += n;
            continue;
        };
        let answer = serde_json::from_str::<Answer>(&text).ok();
        let results = answer.map(|a| a.results);
        if status != 200 || results.as_ref().map(Vec::len) != Some(*n) {
            stats.error();
            retry += n;
            continue;
        }
        for r in results.into_iter().flatten() {
            if r.renewed {
                stats
                    .renewed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            } else if r.reason.as_deref() == Some("shard_unavailable") {
                stats.renew_retried();
                retry += 1;
            } else {
                stats.lose(r.reason.as_deref().unwrap_or("unknown"));
                stats.error();
            }
        }
    }
    retry
}

/// Sleeps without holding the goose user's place in the throttle.
pub async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(n: u64) -> Vec<Held> {
        (0..n)
            .map(|i| Held {
                lock_id: format!("id-{i}"),
                token: 100 + i,
            })
            .collect()
    }

    /// What a chunk's body must say, and what `update` wrote, as JSON.
    fn fresh(locks: &[Held]) -> (usize, Value) {
        let items: Vec<_> = locks
            .iter()
            .map(|l| json!({"lockId": l.lock_id, "fencingToken": l.token}))
            .collect();
        (locks.len(), json!({ "locks": items }))
    }

    fn read(chunk: &(usize, Bytes)) -> (usize, Value) {
        (chunk.0, serde_json::from_slice(&chunk.1).expect("JSON"))
    }

    #[test]
    fn renew_bodies_follow_a_growing_list_and_write_only_changed_chunks() {
        let mut bodies = RenewBodies::default();
        let locks = held(7);
        let first: Vec<_> = bodies.update(&locks[..5], 3).to_vec();
        assert_eq!(first.len(), 2);
        assert_eq!(read(&first[0]), fresh(&locks[..3]));
        assert_eq!(read(&first[1]), fresh(&locks[3..5]));

        let grown = bodies.update(&locks, 3).to_vec();
        assert_eq!(grown.len(), 3);
        for (k, chunk) in locks.chunks(3).enumerate() {
            assert_eq!(read(&grown[k]), fresh(chunk), "chunk {k}");
        }
        // The full chunk was kept as it was, not written again.
        assert_eq!(grown[0].1.as_ptr(), first[0].1.as_ptr());
        assert_ne!(grown[1].1.as_ptr(), first[1].1.as_ptr());

        // A larger batch size regroups the same list.
        let regrouped = bodies.update(&locks, 10).to_vec();
        assert_eq!(regrouped.len(), 1);
        assert_eq!(read(&regrouped[0]), fresh(&locks));
    }
}
