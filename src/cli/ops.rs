//! The operator's subcommands, each a call or a few to a router's API:
//! `inspect NAME` (who holds a name), `locks` (the held locks, by prefix,
//! a page at a time), `client ID` (what a client holds), `ring` (the ring,
//! shards and migration), `status` (`/readyz` and the ring), and the
//! calls that change something: `force-release NAME --reason R
//! [--if-token T]`, `reload` and `bump-epoch`. The router, its CA and the
//! token come from the connection flags every command shares ([`Target`]).
//! The reading commands print a table, JSON or YAML ([`Format`]; the
//! tables are in [`views`]); the others print the router's JSON answer as
//! it came. The exit code says how it went (see [`codes`], and
//! [`EXIT_CODES`] and its kin for `--help`).

use std::collections::HashMap;
use std::time::SystemTime;

use futures::StreamExt;
use http::{Method, StatusCode};
use serde_json::Value;

use super::conn::{Conn, Failed};
use super::output::{self, Format};
use super::target::Target;
use super::views;

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
  0   the router answered 2xx; its answer is on stdout
  64  a bad request (400, 404, 405, 413, 415)
  69  the router is unavailable (5xx) or cannot be reached
  75  refused for now (409, 429): try again later
  77  no or a wrong credential (401, 403)
Error answers go to stdout as JSON or YAML (-o json, -o yaml), to stderr
as a line with a table; other problems go to stderr.";

/// `--help`'s account of [`codes`] for `status`.
pub const STATUS_EXIT_CODES: &str = "\
Exit codes (as in sysexits.h):
  0   the replica is ready (/readyz 200)
  69  it is not ready (/readyz 503; the status is still shown), or it
      cannot be reached
  64  a bad request (/readyz 4xx: not a router?)
The ring needs the admin credential (401 or 403 leave it out of the
answer and do not change the exit code).";

/// `--help`'s account of [`codes`] for `bump-epoch`.
pub const BUMP_EPOCH_EXIT_CODES: &str = "\
Exit codes (as in sysexits.h):
  0   bumped: the epoch now recorded on every shard is on stdout
  75  refused (409): a shard does not answer, records nothing (name it
      with --reinitialize once you know it lost its data) or records
      another ring; the message on stdout says which. A bump that
      stopped part-way is safe to repeat
  64  a bad request (400)
  69  the router is unavailable (5xx) or cannot be reached
  77  no or a wrong admin credential (401, 403)";

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
    /// One page of held locks (every page, with `all`).
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
    /// `/readyz`, and the ring when the credential allows.
    Status,
    /// Records the next ring epoch on every shard.
    BumpEpoch {
        reinitialize: Vec<String>,
        min_epoch: Option<u64>,
    },
}

fn encoded(name: &str) -> String {
    percent_encoding::utf8_percent_encode(name, percent_encoding::NON_ALPHANUMERIC).to_string()
}

impl Call {
    fn request(&self) -> (Method, String, Option<serde_json::Value>) {
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
            Call::Ring => (Method::GET, RING.into(), None),
            Call::Reload => (
                Method::POST,
                "/admin/v1/reload".into(),
                Some(serde_json::json!({})),
            ),
            Call::Status => (Method::GET, "/readyz".into(), None),
            Call::BumpEpoch {
                reinitialize,
                min_epoch,
            } => {
                let mut body = serde_json::json!({});
                if !reinitialize.is_empty() {
                    body["reinitialize"] = reinitialize.clone().into();
                }
                if let Some(min) = min_epoch {
                    body["minEpoch"] = (*min).into();
                }
                (Method::POST, "/admin/v1/bump-epoch".into(), Some(body))
            }
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

/// The admin ring route (`ring`, and `status` for the ring's epoch).
const RING: &str = "/admin/v1/ring";

/// Whether a force-release's answer says it released a lock.
fn released(body: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(body)
        .is_ok_and(|answer| answer["released"] == serde_json::Value::Bool(true))
}

/// Runs `call` against `target`; prints the answer in `format` (the calls
/// that change something, force-release, reload and bump-epoch, print the
/// router's JSON as it came); returns the exit code.
pub fn run(target: &Target, call: &Call, format: Format) -> u8 {
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
    let outcome = runtime.block_on(async {
        let conn = Conn::new(target)?;
        match call {
            Call::Locks { .. } => locks(&conn, call.clone(), format).await,
            Call::Status => status(&conn, format).await,
            Call::Inspect { .. } | Call::Client { .. } | Call::Ring => {
                let (status, body) = send(&conn, call).await?;
                let shown = match call {
                    Call::Inspect { .. } => show(format, &body, |v| {
                        Ok(views::inspect(
                            &serde_json::from_value(v)?,
                            SystemTime::now(),
                        ))
                    }),
                    Call::Client { .. } => show(format, &body, |v| {
                        Ok(views::client(
                            &serde_json::from_value(v)?,
                            SystemTime::now(),
                        ))
                    }),
                    _ => show(format, &body, |v| {
                        Ok(views::ring(&serde_json::from_value(v)?))
                    }),
                };
                Ok(shown.unwrap_or(call.exit_code(status, &body)))
            }
            Call::ForceRelease { .. } | Call::Reload | Call::BumpEpoch { .. } => {
                let (status, body) = send(&conn, call).await?;
                println!("{}", body.trim_end());
                let code = call.exit_code(status, &body);
                if let (codes::NOT_HELD, Call::ForceRelease { name, .. }) = (code, call) {
                    eprintln!("lockrouter: nothing held {name:?}: nothing was released");
                }
                Ok(code)
            }
        }
    });
    outcome.unwrap_or_else(|e: Failed| {
        eprintln!("lockrouter: {e}");
        match e {
            Failed::Usage(_) => codes::USAGE,
            Failed::Unavailable(_) => codes::UNAVAILABLE,
        }
    })
}

async fn send(conn: &Conn, call: &Call) -> Result<(StatusCode, String), Failed> {
    let (method, path, body) = call.request();
    conn.send(method, &path, body).await
}

/// Prints an answer in `format`: JSON or YAML on stdout (an error answer
/// too, as scripts read it); as a table, what `view` makes of it (its
/// typed view, rendered) on stdout, or an error answer's code and message
/// on stderr. `Some(exit code)` when the answer could not be shown as
/// asked.
fn show(
    format: Format,
    body: &str,
    view: impl Fn(Value) -> Result<String, serde_json::Error>,
) -> Option<u8> {
    let Ok(value) = serde_json::from_str::<Value>(body) else {
        // Not the router's JSON (a proxy's error page, say): as it came.
        match format {
            Format::Table => eprintln!("lockrouter: the answer is not JSON: {}", body.trim_end()),
            _ => println!("{}", body.trim_end()),
        }
        return None;
    };
    match format {
        Format::Json => println!("{}", output::json(&value)),
        Format::Yaml => print!("{}", output::yaml(&value)),
        Format::Table => match error_of(&value) {
            Some(error) => eprintln!("lockrouter: {error}"),
            None => match view(value) {
                Ok(table) => print!("{table}"),
                Err(e) => {
                    eprintln!("lockrouter: the answer is not what this command reads: {e}");
                    return Some(codes::UNAVAILABLE);
                }
            },
        },
    }
    None
}

/// `code: message` of an error answer.
fn error_of(value: &Value) -> Option<String> {
    let error = value.get("error")?;
    Some(format!(
        "{}: {}",
        error["code"].as_str().unwrap_or("error"),
        error["message"].as_str().unwrap_or("")
    ))
}

/// `locks`: a page, or with `all` every page following `nextCursor`. As
/// JSON or YAML one page is the router's answer, and `--all` prints one
/// lock a line (JSON) or a document per page (YAML); as a table each lock
/// also shows its expiry, read by inspecting it (see [`expiries`]).
async fn locks(conn: &Conn, mut call: Call, format: Format) -> Result<u8, Failed> {
    let all = matches!(call, Call::Locks { all: true, .. });
    let mut first = true;
    loop {
        let (status, body) = send(conn, &call).await?;
        let page = serde_json::from_str::<views::Page>(&body).ok();
        let Some(page) = page.filter(|_| status.is_success()) else {
            if let Some(code) = show(format, &body, |_| Ok(String::new())) {
                return Ok(code);
            }
            return Ok(call.exit_code(status, &body));
        };
        match format {
            Format::Json if all => {
                let value: Value = serde_json::from_str(&body).unwrap_or_default();
                for lock in value["locks"].as_array().into_iter().flatten() {
                    println!("{}", output::json_line(lock));
                }
            }
            Format::Json | Format::Yaml => {
                let value: Value = serde_json::from_str(&body).unwrap_or_default();
                if format == Format::Json {
                    println!("{}", output::json(&value));
                } else {
                    // Each page a document of its own (each starts with `---`).
                    print!("{}", output::yaml(&value));
                }
            }
            Format::Table => {
                let expiries = expiries(conn, &page).await;
                let table = views::locks(&page, &expiries, SystemTime::now());
                // kubectl's way with chunks: the header once, each page's
                // columns as wide as that page needs.
                let skip = if first { 0 } else { 1 };
                for line in table.lines().skip(skip) {
                    println!("{line}");
                }
            }
        }
        first = false;
        match (&mut call, page.next_cursor) {
            (Call::Locks { cursor, .. }, Some(next)) if all => *cursor = Some(next),
            (_, Some(next)) if format == Format::Table => {
                eprintln!("lockrouter: more locks: --cursor {next} (or --all)");
                return Ok(0);
            }
            _ => return Ok(0),
        }
    }
}

/// Inspects at once.
const INSPECTS_IN_FLIGHT: usize = 8;

/// Each listed lock's expiry, by name: the listing does not carry it, so
/// each name is inspected (a read, no raft write), a few at a time.
/// `None` for a lock whose grant was gone by then (released, expired or
/// taken by another: the inspect shows another token or none); no entry
/// when the inspect failed.
async fn expiries(conn: &Conn, page: &views::Page) -> HashMap<String, Option<String>> {
    futures::stream::iter(&page.locks)
        .map(|l| expiry(conn, l))
        .buffer_unordered(INSPECTS_IN_FLIGHT)
        .filter_map(|found| async move { found })
        .collect()
        .await
}

/// One listed lock's entry of [`expiries`].
async fn expiry(conn: &Conn, l: &views::Listed) -> Option<(String, Option<String>)> {
    let call = Call::Inspect {
        name: l.name.clone(),
    };
    let (status, body) = send(conn, &call).await.ok()?;
    if !status.is_success() {
        return None;
    }
    let seen: views::Inspected = serde_json::from_str(&body).ok()?;
    let same = seen.held && seen.fencing_token == Some(l.fencing_token);
    Some((l.name.clone(), seen.expires_at.filter(|_| same)))
}

/// `status`: `GET /readyz`, and `GET /admin/v1/ring` for the ring and each
/// shard's role, weight and epoch. Without the admin credential the ring
/// is left out (a table says so; JSON has `"ring": null`). The exit code
/// is `/readyz`'s: 0 ready, 69 not ready (503).
async fn status(conn: &Conn, format: Format) -> Result<u8, Failed> {
    let (ready_status, ready_body) = send(conn, &Call::Status).await?;
    let code = Call::Status.exit_code(ready_status, &ready_body);
    let Ok(ready) = serde_json::from_str::<Value>(&ready_body) else {
        show(format, &ready_body, |_| Ok(String::new()));
        return Ok(code);
    };
    if error_of(&ready).is_some() {
        return Ok(show(format, &ready_body, |_| Ok(String::new())).unwrap_or(code));
    }
    let ring = match send(conn, &Call::Ring).await {
        Ok((s, body)) if s.is_success() => serde_json::from_str::<Value>(&body).ok(),
        Ok((s, _)) if matches!(s.as_u16(), 401 | 403) => None,
        Ok((s, body)) => {
            let why = serde_json::from_str::<Value>(&body)
                .ok()
                .and_then(|v| error_of(&v))
                .unwrap_or_else(|| s.to_string());
            eprintln!("lockrouter: {RING}: {why}");
            None
        }
        Err(e) => {
            eprintln!("lockrouter: {RING}: {e}");
            None
        }
    };
    let both = serde_json::json!({ "readyz": ready, "ring": ring });
    let shown = show(format, &both.to_string(), |v| {
        let ready = serde_json::from_value(v["readyz"].clone())?;
        let ring: Option<views::RingView> = serde_json::from_value(v["ring"].clone())?;
        Ok(views::status(&ready, ring.as_ref()))
    });
    Ok(shown.unwrap_or(code))
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
