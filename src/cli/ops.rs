//! The operator's subcommands, each one call to a router's API (`locks
//! --all` one per page): `inspect NAME` (who holds a name), `locks`
//! (the held locks, by prefix), `client ID` (what a client holds),
//! `force-release NAME --reason R [--if-token T]`, `ring` (the ring,
//! shards and migration) and `reload`. The router, its CA and the token
//! come from the connection flags every command shares ([`Target`]). The
//! answer's JSON body goes to stdout; the exit code says how it went (see
//! [`codes`], and [`EXIT_CODES`] and its kin for `--help`).

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::target::Target;

/// Exit codes besides 0 (a 2xx answer), as in sysexits.h.
pub mod codes {
    /// 400, 404, 405, 413, 415: the request was wrong (EX_USAGE).
    pub const USAGE: u8 = 64;
    /// `force-release --if-token`: another grant holds the name (409);
    /// nothing was released (EX_DATAERR).
    pub const OTHER_GRANT: u8 = 65;
    /// `force-release`: nothing held the name; nothing was released
    /// (EX_NOINPUT).
    pub const NOT_HELD: u8 = 66;
    /// 5xx, or the router could not be reached (EX_UNAVAILABLE).
    pub const UNAVAILABLE: u8 = 69;
    /// 409 (a reload not possible now) or 429: try again later
    /// (EX_TEMPFAIL).
    pub const TEMPFAIL: u8 = 75;
    /// 401 or 403: no or wrong admin token (EX_NOPERM).
    pub const NOPERM: u8 = 77;
}

/// `--help`'s account of [`codes`] for the operator's commands.
pub const EXIT_CODES: &str = "\
Exit codes (as in sysexits.h):
  0   the router answered 2xx; its JSON answer is on stdout
  64  a bad request (400, 404, 405, 413, 415)
  69  the router is unavailable (5xx) or cannot be reached
  75  refused for now (409, 429): try again later
  77  no or a wrong credential (401, 403)
Error answers are JSON on stdout too; other problems go to stderr.";

/// `--help`'s account of [`codes`] for `force-release`.
pub const FORCE_RELEASE_EXIT_CODES: &str = "\
Exit codes (as in sysexits.h):
  0   released: the former holder's token and clientId are on stdout
  66  nothing held NAME (a typo?): nothing was released
  65  --if-token: another grant holds NAME (409), e.g. a healthy worker
      that took it after you looked: nothing was released
  64  a bad request: an empty reason, a token no router issues (400)
  69  the router is unavailable (5xx) or cannot be reached
  77  no or a wrong admin credential (401, 403)";

/// `--help`'s account of [`codes`] for `reload`.
pub const RELOAD_EXIT_CODES: &str = "\
Exit codes (as in sysexits.h):
  0   reloaded: what changed is on stdout
  75  refused (409): not possible now (a migration is open, a shard is
      unreachable: try again later), or the change takes a restart; the
      message on stdout says which. Nothing changed
  64  the config file is invalid (400); nothing changed
  69  the router is unavailable (5xx) or cannot be reached
  77  no or a wrong admin credential (401, 403)";

/// One operator call.
#[derive(Debug, Clone)]
pub enum Call {
    Inspect {
        name: String,
    },
    /// One page of held locks (every page, one lock a line, with `all`).
    Locks {
        prefix: String,
        limit: u32,
        cursor: Option<String>,
        all: bool,
    },
    Client {
        client_id: String,
        principal: Option<String>,
    },
    /// Takes `name` from its holder; with `if_token`, only from the grant
    /// with that fencing token.
    ForceRelease {
        name: String,
        reason: String,
        if_token: Option<u64>,
    },
    Ring,
    Reload,
}

impl Call {
    fn request(&self) -> (Method, String, Option<serde_json::Value>) {
        let encoded = |name: &str| {
            percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC)
                .to_string()
        };
        match self {
            Call::Inspect { name } => (
                Method::GET,
                format!("/api/v1/locks/{}", encoded(name)),
                None,
            ),
            Call::ForceRelease {
                name,
                reason,
                if_token,
            } => {
                let mut body = serde_json::json!({ "reason": reason });
                if let Some(token) = if_token {
                    body["fencingToken"] = (*token).into();
                }
                (
                    Method::POST,
                    format!("/admin/v1/locks/{}/force-release", encoded(name)),
                    Some(body),
                )
            }
            Call::Locks {
                prefix,
                limit,
                cursor,
                ..
            } => {
                let mut query = form_urlencoded::Serializer::new(String::new());
                query.append_pair("prefix", prefix);
                query.append_pair("limit", &limit.to_string());
                if let Some(c) = cursor {
                    query.append_pair("cursor", c);
                }
                (
                    Method::GET,
                    format!("/admin/v1/locks?{}", query.finish()),
                    None,
                )
            }
            Call::Client {
                client_id,
                principal,
            } => {
                let mut path = format!("/admin/v1/clients/{}", encoded(client_id));
                if let Some(p) = principal {
                    path.push_str("?principal=");
                    path.push_str(&encoded(p));
                }
                (Method::GET, path, None)
            }
            Call::Ring => (Method::GET, "/admin/v1/ring".into(), None),
            Call::Reload => (
                Method::POST,
                "/admin/v1/reload".into(),
                Some(serde_json::json!({})),
            ),
        }
    }

    /// The exit code of an answer to this call (see [`codes`]).
    fn exit_code(&self, status: StatusCode, body: &str) -> u8 {
        let force = matches!(self, Call::ForceRelease { .. });
        match status.as_u16() {
            200..=299 if force && !released(body) => codes::NOT_HELD,
            200..=299 => 0,
            401 | 403 => codes::NOPERM,
            409 if force => codes::OTHER_GRANT,
            409 | 429 => codes::TEMPFAIL,
            400..=499 => codes::USAGE,
            _ => codes::UNAVAILABLE,
        }
    }
}

/// Whether a force-release's answer says it released a lock.
fn released(body: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(body)
        .is_ok_and(|answer| answer["released"] == serde_json::Value::Bool(true))
}

/// Runs `call` against `target`; prints the answer; returns the exit code.
pub fn run(target: &Target, call: &Call) -> u8 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockrouter: cannot start the runtime: {e}");
            return codes::UNAVAILABLE;
        }
    };
    let outcome = match call {
        Call::Locks { all: true, .. } => runtime.block_on(every_page(target, call.clone())),
        _ => runtime.block_on(send(target, call)).map(|(status, body)| {
            println!("{}", body.trim_end());
            let code = call.exit_code(status, &body);
            if let (codes::NOT_HELD, Call::ForceRelease { name, .. }) = (code, call) {
                eprintln!("lockrouter: nothing held {name:?}: nothing was released");
            }
            code
        }),
    };
    outcome.unwrap_or_else(|e| {
        eprintln!("lockrouter: {e}");
        e.code
    })
}

/// `locks --all`: every page, following `nextCursor`, one lock a line.
async fn every_page(target: &Target, mut call: Call) -> Result<u8, Failed> {
    loop {
        let (status, body) = send(target, &call).await?;
        if !status.is_success() {
            println!("{}", body.trim_end());
            return Ok(call.exit_code(status, &body));
        }
        let page: serde_json::Value = serde_json::from_str(&body).map_err(|e| Failed {
            code: codes::UNAVAILABLE,
            why: format!("the router's answer is not JSON: {e}"),
        })?;
        for lock in page["locks"].as_array().into_iter().flatten() {
            println!("{lock}");
        }
        let next = page["nextCursor"].as_str().map(str::to_string);
        match (&mut call, next) {
            (Call::Locks { cursor, .. }, Some(next)) => *cursor = Some(next),
            _ => return Ok(0),
        }
    }
}

#[derive(Debug)]
struct Failed {
    code: u8,
    why: String,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

async fn send(target: &Target, call: &Call) -> Result<(StatusCode, String), Failed> {
    let (method, path, body) = call.request();
    let base = target.url.trim_end_matches('/');
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(Failed {
            code: codes::USAGE,
            why: format!("--url must be an http:// or https:// URL, got {base:?}"),
        });
    }
    let usage = |why: String| Failed {
        code: codes::USAGE,
        why,
    };
    let ca = target.ca_pem().map_err(usage)?;
    let connector = lockrouter_client::connector(ca.as_deref())
        .map_err(|e| usage(format!("--ca-file: {e}")))?;
    let mut req = Request::builder()
        .method(method)
        .uri(format!("{base}{path}"));
    if let Some(token) = &target.token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let body = match body {
        Some(json) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Full::new(Bytes::from(json.to_string()))
        }
        None => Full::new(Bytes::new()),
    };
    let req = req.body(body).map_err(|e| Failed {
        code: codes::USAGE,
        why: format!("bad request for {base}: {e}"),
    })?;
    let client = Client::builder(TokioExecutor::new()).build(connector);
    let unavailable = |why: String| Failed {
        code: codes::UNAVAILABLE,
        why,
    };
    let resp = tokio::time::timeout(Duration::from_secs(60), client.request(req))
        .await
        .map_err(|_| unavailable(format!("{base} did not answer within 60 s")))?
        .map_err(|e| unavailable(format!("cannot reach {base}: {e}")))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| unavailable(format!("the answer from {base} broke off: {e}")))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_percent_encoded_and_statuses_map_to_sysexits() {
        let force = |if_token| Call::ForceRelease {
            name: "process_order:42/a b".into(),
            reason: "stuck".into(),
            if_token,
        };
        let (m, path, body) = force(None).request();
        assert_eq!(m, Method::POST);
        assert_eq!(
            path,
            "/admin/v1/locks/process%5Forder%3A42%2Fa%20b/force-release"
        );
        let body = body.unwrap();
        assert_eq!(body["reason"], "stuck");
        assert!(body.get("fencingToken").is_none(), "{body}");
        assert_eq!(force(Some(4711)).request().2.unwrap()["fencingToken"], 4711);
        let code =
            |call: &Call, status, body| call.exit_code(StatusCode::from_u16(status).unwrap(), body);
        for (status, exit) in [
            (200, 0),
            (204, 0),
            (400, 64),
            (404, 64),
            (401, 77),
            (403, 77),
            (409, 75),
            (429, 75),
            (503, 69),
            (504, 69),
        ] {
            assert_eq!(code(&Call::Reload, status, ""), exit, "{status}");
        }
        let force = force(Some(4711));
        assert_eq!(code(&force, 200, r#"{"released":true}"#), 0);
        assert_eq!(code(&force, 200, r#"{"released":false}"#), 66);
        assert_eq!(code(&force, 409, "{}"), 65);
        assert_eq!(code(&force, 400, "{}"), 64);
    }
}
