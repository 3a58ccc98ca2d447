//! Input rules of the lock operations, checked once at the start of each:
//! names and clientIds (1 to a limit of bytes of UTF-8, no control
//! characters) and TTLs (within the configured bounds, rounded up to the
//! whole seconds etcd leases have).
//!
//! A checked name and a checked TTL are types ([`LockName`],
//! [`SessionTtl`]) that only their check makes: code past the check takes
//! them and never checks again, and cannot be handed an unchecked value.

use crate::config::Limits;

/// A request input that breaks a rule; the message says which and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// A lock's name as checked: 1 to `limits.max_name_bytes` bytes of UTF-8
/// without control characters. Only [`LockName::parse`] makes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockName(String);

impl LockName {
    /// `name`, if it keeps the name rules of `limits`.
    pub(crate) fn parse(name: String, limits: &Limits) -> Result<Self, Invalid> {
        check_text("name", &name, limits.max_name_bytes)?;
        Ok(Self(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The TTL of a lock, and of the session lease it rides on: whole seconds
/// (etcd's leases have no others), `ttlMs` rounded up so the lock lives at
/// least that long, within the limits it was checked against. Only
/// [`SessionTtl::parse`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTtl(u32);

impl SessionTtl {
    /// The TTL of a lock asked for `ttl_ms`, if `limits` allow it.
    pub(crate) fn parse(ttl_ms: u64, limits: &Limits) -> Result<Self, Invalid> {
        let (min, max) = (limits.min_ttl_ms, limits.max_ttl_ms);
        let out_of_range = || invalid(format!("ttlMs must be {min} to {max}, got {ttl_ms}"));
        if !(min..=max).contains(&ttl_ms) {
            return Err(out_of_range());
        }
        // Limits past u32 seconds are refused at config load (one day at
        // most); this keeps a hand-made `Limits` from wrapping.
        let secs = u32::try_from(ttl_ms.div_ceil(1000)).map_err(|_| out_of_range())?;
        Ok(Self(secs))
    }

    /// In whole seconds, as etcd grants leases and a lockId records them.
    pub fn secs(self) -> u32 {
        self.0
    }
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
    fn a_lock_name_is_made_only_of_a_name_within_the_limits() {
        let limits = Limits {
            max_name_bytes: 8,
            ..Limits::default()
        };
        let name = |n: &str| LockName::parse(n.to_string(), &limits);
        assert_eq!(name("order:42").unwrap().as_str(), "order:42");
        assert_eq!(name("日本").unwrap().as_str(), "日本");
        // The bound is in bytes: 9 of them, in three characters, is over.
        assert_eq!(
            name("日本語").unwrap_err().to_string(),
            "name must be 1 to 8 bytes, got 9"
        );
        assert_eq!(
            name("").unwrap_err().to_string(),
            "name must be 1 to 8 bytes, got 0"
        );
        assert_eq!(
            name("a\nb").unwrap_err().to_string(),
            "name must not contain control characters"
        );
    }

    #[test]
    fn a_session_ttl_is_whole_seconds_rounded_up_within_the_limits() {
        let limits = Limits::default();
        let ttl = |ms| SessionTtl::parse(ms, &limits).map(SessionTtl::secs);
        assert_eq!(ttl(2_000), Ok(2), "the least TTL allowed");
        assert_eq!(ttl(2_001), Ok(3), "never shorter than asked");
        assert_eq!(ttl(2_999), Ok(3));
        assert_eq!(ttl(3_600_000), Ok(3_600), "the most allowed");
        assert_eq!(
            ttl(1_999).unwrap_err().to_string(),
            "ttlMs must be 2000 to 3600000, got 1999"
        );
        assert!(ttl(3_600_001).is_err());
        assert!(ttl(0).is_err());
        // Limits a config would refuse still make no TTL that wraps.
        let unchecked = Limits {
            max_ttl_ms: u64::MAX,
            ..Limits::default()
        };
        assert!(SessionTtl::parse(u64::MAX, &unchecked).is_err());
        let most = u64::from(u32::MAX) * 1_000;
        assert_eq!(
            SessionTtl::parse(most, &unchecked).map(SessionTtl::secs),
            Ok(u32::MAX)
        );
    }
}
