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

#[cfg(test)]
mod tests {
    use super::*;

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
