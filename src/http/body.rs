//! Request bodies: method, media type and size checks, a read under the
//! body deadline, and JSON parsing whose errors name where in the body it
//! went wrong (only a body that fails is parsed a second time for that).

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Refuses `req` with 405 unless it uses `method`.
pub fn only(req: &Request<Incoming>, method: Method, allow: &'static str) -> Result<(), ApiError> {
    if req.method() == method {
        Ok(())
    } else {
        Err(ApiError::method_not_allowed(allow))
    }
}

/// Checks method, media type and size, then parses the JSON body.
pub async fn parse<T: DeserializeOwned>(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<T, ApiError> {
    only(&req, Method::POST, "POST")?;
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as Content-Type: application/json",
        ));
    }
    let body = read_body(req, max, deadline).await?;
    from_json(&body)
}

/// Like [`parse`], but an empty body (with or without a media type) is
/// the default value.
pub async fn parse_optional<T: DeserializeOwned + Default>(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<T, ApiError> {
    let typed = req.headers().contains_key(header::CONTENT_TYPE);
    let declared_empty = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .is_some_and(|v| v.as_bytes() == b"0");
    if typed && !declared_empty {
        return parse(req, max, deadline).await;
    }
    let body = read_body(req, max, deadline).await?;
    if body.is_empty() {
        return Ok(T::default());
    }
    Err(ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        "send the body as Content-Type: application/json",
    ))
}

/// Reads at most `max` bytes of body within `deadline`.
async fn read_body(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body may be at most {max} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let collect = Limited::new(req.into_body(), max).collect();
    let collected = tokio::time::timeout(deadline, collect).await.map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            format!("the body did not arrive within {} ms", deadline.as_millis()),
        )
    })?;
    Ok(collected
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                too_large()
            } else {
                ApiError::invalid(format!("could not read the body: {e}"))
            }
        })?
        .to_bytes())
}

/// Parses JSON; the error names where in the body it went wrong.
fn from_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // The fast path first; only a body that fails is parsed again to find
    // the path of the problem.
    if let Ok(value) = serde_json::from_slice(body) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, T>(&mut de) {
        // The strict parse refused it, so something follows the value
        // (`from_slice` also requires the end of input): never a grant.
        Ok(_) => Err(match de.end() {
            Err(e) => ApiError::invalid(format!("invalid JSON body: {e}")),
            Ok(()) => ApiError::invalid("invalid JSON body"),
        }),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Err(if path.is_empty() || path == "." {
                ApiError::invalid(format!("invalid JSON body: {inner}"))
            } else {
                ApiError::invalid(format!("invalid JSON body: {path}: {inner}"))
            })
        }
    }
}
