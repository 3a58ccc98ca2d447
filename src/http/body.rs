//! Request bodies: method, media type and size checks, a read under the
//! body deadline, and JSON parsing whose errors name where in the body it
//! went wrong (only a body that fails is parsed a second time for that).

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;
use serde::Deserialize;

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
    from_json(&read_json(req, max, deadline).await?)
}

/// Checks method, media type and size, and reads the body, for a caller
/// that parses it into values borrowing from it ([`from_json`]).
pub async fn read_json(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<Bytes, ApiError> {
    only(&req, Method::POST, "POST")?;
    require_json(&req)?;
    read_body(req, max, deadline).await
}

/// Like [`parse`], but an empty body is the default value. The media type
/// is required all the same: a web page's cross-site form can send an
/// empty body, but not as `application/json` (that takes a CORS
/// preflight, which the router never grants).
pub async fn parse_optional<T: DeserializeOwned + Default>(
    req: Request<Incoming>,
    max: usize,
    deadline: Duration,
) -> Result<T, ApiError> {
    require_json(&req)?;
    let body = read_body(req, max, deadline).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    from_json(&body)
}

fn require_json(req: &Request<Incoming>) -> Result<(), ApiError> {
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if is_json {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as Content-Type: application/json",
        ))
    }
}

/// How many bytes past the limit an oversized body is read and thrown
/// away before the 413 goes out. A client that is still sending when the
/// router closes the connection gets a reset, not the answer, so the
/// router reads on (within the body deadline) and the client reads a 413;
/// a body larger still is cut off.
const DRAIN_PAST_LIMIT: u64 = 8 << 20;

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
    let mut body = req.into_body();
    let read = async {
        if declared.is_some_and(|n| n > max as u64) {
            return Err(too_large());
        }
        let collected = Limited::new(&mut body, max).collect().await;
        Ok(collected
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    too_large()
                } else {
                    ApiError::invalid(format!("could not read the body: {e}"))
                }
            })?
            .to_bytes())
    };
    let started = tokio::time::Instant::now();
    let result = tokio::time::timeout(deadline, read).await.map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            format!("the body did not arrive within {} ms", deadline.as_millis()),
        )
    })?;
    if matches!(&result, Err(e) if e.status == StatusCode::PAYLOAD_TOO_LARGE)
        && declared.is_none_or(|n| n <= max as u64 + DRAIN_PAST_LIMIT)
    {
        let _ = tokio::time::timeout_at(started + deadline, drain(&mut body)).await;
    }
    result
}

/// Reads and drops the rest of `body`, at most [`DRAIN_PAST_LIMIT`] bytes.
async fn drain(body: &mut Incoming) {
    let mut dropped = 0u64;
    while let Some(Ok(frame)) = body.frame().await {
        dropped += frame.data_ref().map_or(0, |d| d.len() as u64);
        if dropped > DRAIN_PAST_LIMIT {
            return;
        }
    }
}

/// Parses JSON; the error names where in the body it went wrong.
pub fn from_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
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
