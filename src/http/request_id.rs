//! Request ids: every request is named in its answer (`X-Request-Id`, and
//! `requestId` in an error's body) and on every log line it causes. A
//! caller's `X-Request-Id` is kept when it is usable (1 to 128 visible
//! ASCII characters); else the trace id of a W3C `traceparent` is used, so
//! the router's lines join the caller's trace; else one is made up.

use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, HeaderName};

/// The header a request id comes in and goes out in.
pub const HEADER: &str = "x-request-id";
/// [`HEADER`], parsed once: a header looked up by a string is parsed and
/// checked on every request.
pub const HEADER_NAME: HeaderName = HeaderName::from_static(HEADER);
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// Longest caller-supplied id kept.
const MAX_LEN: usize = 128;

/// The id of a request with `headers`.
pub fn of(headers: &HeaderMap) -> String {
    if let Some(id) = headers
        .get(&HEADER_NAME)
        .and_then(|v| v.to_str().ok())
        .filter(|v| usable(v))
    {
        return id.to_string();
    }
    if let Some(trace) = headers
        .get(&TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(trace_id)
    {
        return trace.to_string();
    }
    generated()
}

fn usable(id: &str) -> bool {
    (1..=MAX_LEN).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

/// The trace id of a `traceparent` value (`version-traceid-parentid-flags`,
/// W3C Trace Context): 32 lowercase hex digits, not all zero.
fn trace_id(value: &str) -> Option<&str> {
    let mut parts = value.trim().split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && hex(flags, 2);
    valid.then_some(trace)
}

/// 32 hex digits: a random prefix per process and a counter, so ids are
/// unique across replicas and restarts without a random draw per request.
pub(crate) fn generated() -> String {
    use std::hash::BuildHasher;
    static PREFIX: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(|| {
        std::collections::hash_map::RandomState::new().hash_one(std::process::id())
    });
    let next = NEXT.fetch_add(1, Ordering::Relaxed);
    // Not `format!`: its machinery took about 1 % of the router's CPU here.
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&prefix.to_be_bytes());
    bytes[8..].copy_from_slice(&next.to_be_bytes());
    let mut digits = [0u8; 32];
    hex::encode_to_slice(bytes, &mut digits).expect("16 bytes are 32 digits");
    String::from_utf8(digits.to_vec()).expect("hex digits are ASCII")
}

/// The log's line format, naming the request a line was logged for: the
/// `request{op=.. request_id=.. shard=.. outcome=..}: ` prefix before the
/// target in text, a `span` object in JSON, as a tracing span around each
/// request would give, from the names the request's task keeps
/// ([`crate::task::RequestNames`]). A span costs its fields' formatting on
/// every request (docs/benchmarks.md, "The log level"); these cost
/// something only on the lines logged.
pub struct NamingRequests<F> {
    inner: F,
    json: bool,
}

impl<F> NamingRequests<F> {
    /// Text lines by `inner`.
    pub fn text(inner: F) -> Self {
        Self { inner, json: false }
    }

    /// JSON lines by `inner`.
    pub fn json(inner: F) -> Self {
        Self { inner, json: true }
    }
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for NamingRequests<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let Some(names) = crate::task::request_names(|n| naming(n, self.json)) else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        let plain = tracing_subscriber::fmt::format::Writer::new(&mut line);
        self.inner.format_event(ctx, plain, event)?;
        if self.json {
            // `{...}\n`: the request's object goes in as the last key.
            match line.trim_end().strip_suffix('}') {
                Some(open) => {
                    let comma = if open.ends_with('{') { "" } else { "," };
                    writer.write_str(open)?;
                    write!(writer, "{comma}\"span\":{names}}}")?;
                    return writeln!(writer);
                }
                None => return writer.write_str(&line),
            }
        }
        // Before the target, where a span's prefix goes.
        let target = event.metadata().target();
        match line.find(&format!("{target}: ")) {
            Some(at) => {
                writer.write_str(&line[..at])?;
                write!(writer, "{names}: ")?;
                writer.write_str(&line[at..])
            }
            None => writer.write_str(&line),
        }
    }
}

/// A request's names as a line shows them: text as a span's prefix,
/// `request{op="acquire" request_id=.. shard="a"}`, or a JSON object.
fn naming(n: &crate::task::RequestNames, json: bool) -> String {
    let shard = n.shard();
    if json {
        let mut o = serde_json::Map::new();
        o.insert("op".into(), n.op.into());
        o.insert("request_id".into(), n.id.as_str().into());
        if let Some(shard) = &shard {
            o.insert("shard".into(), serde_json::Value::from(&**shard));
        }
        if let Some(outcome) = n.outcome() {
            o.insert("outcome".into(), outcome.into());
        }
        o.insert("name".into(), "request".into());
        return serde_json::Value::Object(o).to_string();
    }
    use std::fmt::Write as _;
    let mut text = format!("request{{op={:?} request_id={}", n.op, n.id);
    if let Some(shard) = &shard {
        let _ = write!(text, " shard={:?}", &**shard);
    }
    if let Some(outcome) = n.outcome() {
        let _ = write!(text, " outcome={outcome:?}");
    }
    text.push('}');
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{name_outcome, name_shard, naming_sync, RequestNames};
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::fmt::format;
    use tracing_subscriber::fmt::format::JsonFields;

    /// The lines a subscriber wrote.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Lines {
        type Writer = Lines;
        fn make_writer(&'a self) -> Lines {
            self.clone()
        }
    }

    impl Lines {
        fn all(&self) -> Vec<String> {
            let bytes = self.0.lock().unwrap().clone();
            String::from_utf8(bytes)
                .unwrap()
                .lines()
                .map(String::from)
                .collect()
        }
    }

    /// A line outside any request, then two inside one (before and after
    /// its shard and outcome are known), logged through `subscriber`.
    fn log_a_request(subscriber: impl tracing::Subscriber + Send + Sync, id: &str) {
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "lockrouter::t", "outside");
            naming_sync(RequestNames::new("acquire", id.into()), || {
                tracing::warn!(target: "lockrouter::t", "early");
                name_shard("a");
                name_outcome("ok");
                tracing::info!(target: "lockrouter::t", n = 3, "late");
            });
        });
    }

    #[test]
    fn text_lines_logged_while_a_request_is_served_name_it_before_the_target() {
        let lines = Lines::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(lines.clone())
            .event_format(NamingRequests::text(format().with_ansi(false)))
            .finish();
        log_a_request(subscriber, "id-7");
        let all = lines.all();
        assert_eq!(all.len(), 3, "{all:#?}");
        assert!(all[0].ends_with(" WARN lockrouter::t: outside"), "{all:#?}");
        assert!(
            all[1]
                .ends_with(r#" WARN request{op="acquire" request_id=id-7}: lockrouter::t: early"#),
            "{all:#?}"
        );
        assert!(
            all[2].ends_with(
                r#" INFO request{op="acquire" request_id=id-7 shard="a" outcome="ok"}: lockrouter::t: late n=3"#
            ),
            "{all:#?}"
        );
    }

    #[test]
    fn json_lines_logged_while_a_request_is_served_name_it_under_span() {
        let lines = Lines::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(lines.clone())
            .fmt_fields(JsonFields::new())
            .event_format(NamingRequests::json(
                format()
                    .json()
                    .with_current_span(true)
                    .with_span_list(false),
            ))
            .finish();
        // Visible ASCII ids may hold quotes and backslashes.
        log_a_request(subscriber, r#"id-"7"\"#);
        let all: Vec<serde_json::Value> = (lines.all().iter())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(all.len(), 3, "{all:#?}");
        assert_eq!(all[0]["fields"]["message"], "outside");
        assert!(all[0].get("span").is_none(), "{:#}", all[0]);
        let early =
            serde_json::json!({"name": "request", "op": "acquire", "request_id": r#"id-"7"\"#});
        assert_eq!(all[1]["span"], early, "{:#}", all[1]);
        assert_eq!(all[1]["fields"]["message"], "early");
        assert_eq!(all[2]["span"]["shard"], "a", "{:#}", all[2]);
        assert_eq!(all[2]["span"]["outcome"], "ok", "{:#}", all[2]);
        assert_eq!(all[2]["fields"]["n"], 3, "{:#}", all[2]);
        assert_eq!(all[2]["target"], "lockrouter::t", "{:#}", all[2]);
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_usable_caller_id_is_kept_and_a_bad_one_replaced() {
        assert_eq!(of(&headers(&[(HEADER, "job-42/try-1")])), "job-42/try-1");
        let long = "x".repeat(MAX_LEN + 1);
        for bad in ["", "has space", long.as_str()] {
            let id = of(&headers(&[(HEADER, bad)]));
            assert_eq!(id.len(), 32, "{bad:?} gave {id}");
        }
    }

    #[test]
    fn a_traceparent_gives_its_trace_id() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            of(&headers(&[("traceparent", tp)])),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        // The caller's own id wins over the trace.
        assert_eq!(
            of(&headers(&[("traceparent", tp), (HEADER, "mine")])),
            "mine"
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f35-00f067aa0ba902b7-01",
        ] {
            assert_eq!(of(&headers(&[("traceparent", bad)])).len(), 32, "{bad}");
            assert_ne!(of(&headers(&[("traceparent", bad)])), bad);
        }
    }

    #[test]
    fn generated_ids_differ() {
        let (a, b) = (generated(), generated());
        assert_ne!(a, b);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        // The counter is the last 16 digits, the prefix the first 16.
        let counter = |id: &str| u64::from_str_radix(&id[16..], 16).unwrap();
        assert_eq!((a.len(), b.len()), (32, 32));
        assert_eq!(a[..16], b[..16]);
        assert!(counter(&b) > counter(&a), "{a} then {b}");
    }
}
