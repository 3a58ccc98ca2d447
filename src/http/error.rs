//! The one place errors become HTTP responses: a stable snake_case code, the
//! matching status, and a message for people. Internal details are logged,
//! never sent. A refusal more than one layer gives ([`Denied`],
//! [`RateLimited`]) is mapped once, whichever layer's error carries it.

use std::time::Duration;

use super::answers::{json, ErrorBody, ErrorDetail};
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

use crate::auth::AuthError;
use crate::locks::{LockError, RETRY_AFTER};
use crate::refusal::{Denied, RateLimited};

/// An error answer of the v1 API.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<Duration>,
    /// Value of the `Allow` header on 405.
    pub allow: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
            allow: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_denied", message)
    }

    /// 409: the request presumes a state that does not hold (the caller
    /// can look again); nothing changed.
    pub fn failed_precondition(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "failed_precondition", message)
    }

    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "no such route")
    }

    pub fn method_not_allowed(allow: &'static str) -> Self {
        Self {
            allow: Some(allow),
            ..Self::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("use {allow}"),
            )
        }
    }

    /// The answer; `request_id` goes in the body (the `X-Request-Id`
    /// header is set by the caller for every answer).
    pub fn into_response(self, request_id: Option<&str>) -> Response<Full<Bytes>> {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: &self.message,
                request_id,
            },
        };
        let mut resp = json(self.status, &body);
        if let Some(after) = self.retry_after {
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(after.as_secs().max(1)),
            );
        }
        if let Some(allow) = self.allow {
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        resp
    }
}

impl From<Denied> for ApiError {
    fn from(Denied(msg): Denied) -> Self {
        ApiError::forbidden(msg)
    }
}

impl From<RateLimited> for ApiError {
    fn from(e: RateLimited) -> Self {
        ApiError {
            retry_after: Some(e.retry_after.max(Duration::from_secs(1))),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", e.reason)
        }
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Unauthenticated(msg) => {
                ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", msg)
            }
            AuthError::PermissionDenied(denied) => denied.into(),
            AuthError::RateLimited(limited) => limited.into(),
        }
    }
}

impl From<LockError> for ApiError {
    fn from(e: LockError) -> Self {
        match e {
            LockError::InvalidArgument(msg) => ApiError::invalid(msg),
            LockError::PermissionDenied(denied) => denied.into(),
            LockError::ShardUnavailable { shard, detail } => {
                tracing::debug!(%shard, %detail, "shard unavailable");
                ApiError {
                    retry_after: Some(RETRY_AFTER),
                    ..ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "shard_unavailable",
                        format!("shard {shard} is unavailable: {detail}"),
                    )
                }
            }
            LockError::RateLimited(limited) => limited.into(),
            LockError::Overloaded { .. } => ApiError {
                retry_after: Some(RETRY_AFTER),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", e.to_string())
            },
            LockError::Internal(_) | LockError::Etcd(_) => {
                let error: &dyn std::error::Error = &e;
                tracing::error!(error, "internal error");
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "internal error; see the router log",
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn answer(e: ApiError) -> (StatusCode, Option<String>, Bytes) {
        let resp = e.into_response(Some("r-1"));
        let retry =
            (resp.headers().get(header::RETRY_AFTER)).map(|v| v.to_str().unwrap().to_string());
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, retry, body)
    }

    #[tokio::test]
    async fn a_refusal_is_answered_alike_whichever_layer_gives_it() {
        let denied = Denied::new("principal \"pay\" may not use this name");
        let by_auth = answer(AuthError::from(denied.clone()).into()).await;
        let by_locks = answer(LockError::from(denied).into()).await;
        assert_eq!(by_auth, by_locks);
        assert_eq!(by_auth.0, StatusCode::FORBIDDEN);
        assert_eq!(by_auth.1, None);
        assert_eq!(
            by_auth.2,
            r#"{"error":{"code":"permission_denied","message":"principal \"pay\" may not use this name","requestId":"r-1"}}"#
        );

        // A wait under a second is answered as one second.
        let limited = RateLimited {
            reason: "clientId \"w\" is past 3 acquires/s; retry in 200 ms".into(),
            retry_after: Duration::from_millis(200),
        };
        let by_auth = answer(AuthError::from(limited.clone()).into()).await;
        let by_locks = answer(LockError::from(limited).into()).await;
        assert_eq!(by_auth, by_locks);
        assert_eq!(by_auth.0, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(by_auth.1.as_deref(), Some("1"));
        assert_eq!(
            by_auth.2,
            r#"{"error":{"code":"rate_limited","message":"clientId \"w\" is past 3 acquires/s; retry in 200 ms","requestId":"r-1"}}"#
        );
    }

    /// A corrupt value in etcd is a 500 that says nothing of it to the
    /// caller; the error keeps serde's as its source, for the log.
    #[tokio::test]
    async fn a_corrupt_lock_value_is_an_internal_error_that_keeps_its_source() {
        let bad = serde_json::from_slice::<serde_json::Value>(b"{not json").unwrap_err();
        let e = LockError::from(crate::locks::Corrupt::LockValue(bad));
        let source = std::error::Error::source(&e).expect("the corruption");
        let inner = std::error::Error::source(source).expect("serde's error");
        assert!(inner.downcast_ref::<serde_json::Error>().is_some());
        let (status, retry, body) = answer(e.into()).await;
        assert_eq!((status, retry), (StatusCode::INTERNAL_SERVER_ERROR, None));
        assert_eq!(
            body,
            r#"{"error":{"code":"internal","message":"internal error; see the router log","requestId":"r-1"}}"#
        );
    }
}
