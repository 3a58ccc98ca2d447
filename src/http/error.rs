//! The one place errors become HTTP responses: a stable snake_case code, the
//! matching status, and a message for people. Internal details are logged,
//! never sent.

use std::time::Duration;

use super::answers::{json, ErrorBody, ErrorDetail};
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

use crate::auth::AuthError;
use crate::locks::{LockError, RETRY_AFTER};

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

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        match e {
            AuthError::Unauthenticated(msg) => {
                ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", msg)
            }
            AuthError::PermissionDenied(msg) => ApiError::forbidden(msg),
            AuthError::RateLimited { retry_after, .. } => ApiError {
                retry_after: Some(retry_after.max(Duration::from_secs(1))),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", e.to_string())
            },
        }
    }
}

impl From<LockError> for ApiError {
    fn from(e: LockError) -> Self {
        match e {
            LockError::InvalidArgument(msg) => ApiError::invalid(msg),
            LockError::PermissionDenied(msg) => ApiError::forbidden(msg),
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
            LockError::RateLimited {
                reason,
                retry_after,
            } => ApiError {
                retry_after: Some(retry_after),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", reason)
            },
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
