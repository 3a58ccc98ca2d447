//! Input rules of the lock operations, checked once at the start of each:
//! names and clientIds (1 to a limit of bytes of UTF-8, no control
//! characters) and TTLs (within the configured bounds, rounded up to the
//! whole seconds etcd leases have).

use crate::config::Limits;

/// A request input that breaks a rule; the message says which and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// 1 to `max` bytes of UTF-8 without control characters.
pub(crate) fn check_text(field: &str, value: &str, max: usize) -> Result<(), Invalid> {
    if value.is_empty() || value.len() > max {
        return Err(invalid(format!(
            "{field} must be 1 to {max} bytes, got {}",
            value.len()
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(format!(
            "{field} must not contain control characters"
        )));
    }
    Ok(())
}

/// An acquire's `metadata`: a JSON object or string of at most `max` bytes
/// as compact JSON.
pub(crate) fn check_metadata(meta: &serde_json::Value, max: usize) -> Result<(), Invalid> {
    if !(meta.is_object() || meta.is_string()) {
        return Err(invalid("metadata must be a JSON object or a string"));
    }
    let len = serde_json::to_vec(meta).map_or(usize::MAX, |v| v.len());
    if len > max {
        return Err(invalid(format!(
            "metadata must be at most {max} bytes as compact JSON, got {len}"
        )));
    }
    Ok(())
}

/// The lease TTL, in whole seconds, of a lock asked for `ttl_ms`: within
/// the limits, rounded up so the lock lives at least `ttl_ms`.
pub(crate) fn ttl_secs(limits: &Limits, ttl_ms: u64) -> Result<u32, Invalid> {
    let (min, max) = (limits.min_ttl_ms, limits.max_ttl_ms);
    if !(min..=max).contains(&ttl_ms) {
        return Err(invalid(format!(
            "ttlMs must be {min} to {max}, got {ttl_ms}"
        )));
    }
    // etcd leases are whole seconds: round up so the lock lives at least ttlMs.
    Ok(ttl_ms.div_ceil(1000) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_is_a_small_object_or_string() {
        use serde_json::json;
        assert!(check_metadata(&json!({"job": "nightly", "host": "w7"}), 64).is_ok());
        assert!(check_metadata(&json!("batch 7"), 64).is_ok());
        for bad in [json!(1), json!([1]), json!(null), json!(true)] {
            assert!(check_metadata(&bad, 64).is_err(), "{bad}");
        }
        let big = json!({"k": "x".repeat(100)});
        let err = check_metadata(&big, 64).unwrap_err().to_string();
        assert!(err.contains("at most 64"), "{err}");
    }

    #[test]
    fn names_are_bytes_of_utf8_without_control_characters() {
        assert!(check_text("name", "process_order:42", 512).is_ok());
        assert!(check_text("name", "日本", 6).is_ok(), "6 bytes");
        assert!(check_text("name", "日本", 5).is_err(), "counted in bytes");
        assert!(check_text("name", "", 512).is_err());
        for bad in ["a\u{0}b", "tab\there", "del\u{7f}", "c1\u{85}x"] {
            let err = check_text("clientId", bad, 256).unwrap_err().to_string();
            assert!(err.contains("control"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn ttls_round_up_to_whole_seconds_within_the_limits() {
        let limits = Limits::default();
        assert_eq!(ttl_secs(&limits, 2_000).unwrap(), 2);
        assert_eq!(ttl_secs(&limits, 2_001).unwrap(), 3);
        assert_eq!(ttl_secs(&limits, 3_600_000).unwrap(), 3_600);
        assert!(ttl_secs(&limits, 1_999).is_err());
        assert!(ttl_secs(&limits, 3_600_001).is_err());
    }
}
