//! The status page served at `/ui`: one HTML document (`ui.html`) with its
//! style (`ui.css`) and script (`ui.js`) inline, built into the binary. The
//! script reads the router's own routes from the browser and nothing from
//! elsewhere. The page's Content-Security-Policy admits that script and
//! style by their SHA-256 and nothing else, so no other script runs in it,
//! not even one injected through an answer it renders, and it may fetch
//! from its own origin only.
//!
//! The page marks the requests it makes while refreshing itself with
//! [`POLL_HEADER`]; they are left out of the request series, so that the
//! rates it shows (and a dashboard's) do not count an open page's polling.
//! Only reads are left out: an action taken on the page (a force-release)
//! counts like any other.

use std::sync::OnceLock;

use base64::Engine;
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use sha2::{Digest, Sha256};

const HTML: &str = include_str!("ui.html");
const STYLE: &str = include_str!("ui.css");
const SCRIPT: &str = include_str!("ui.js");

/// The header the page sends with each request of its refresh.
pub const POLL_HEADER: &str = "x-lockrouter-status-page";

/// Whether a request is one of the status page's refreshes: a GET (or
/// HEAD) of a read-only route, marked with [`POLL_HEADER`].
pub fn is_poll(
    method: &http::Method,
    route: Option<super::routes::Route>,
    headers: &http::HeaderMap,
) -> bool {
    let read = *method == http::Method::GET || *method == http::Method::HEAD;
    read && route.is_some_and(|r| r.method() == http::Method::GET)
        && headers.contains_key(POLL_HEADER)
}

/// The document and the policy naming its inline parts, made once.
struct Page {
    body: Bytes,
    csp: HeaderValue,
}

fn built() -> &'static Page {
    static PAGE: OnceLock<Page> = OnceLock::new();
    PAGE.get_or_init(|| {
        let body = HTML
            .replace("{{style}}", STYLE)
            .replace("{{script}}", SCRIPT);
        let csp = format!(
            "default-src 'none'; script-src '{}'; style-src '{}'; connect-src 'self'; \
             img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            sha256(SCRIPT),
            sha256(STYLE)
        );
        Page {
            body: Bytes::from(body),
            csp: HeaderValue::from_str(&csp).expect("a header value"),
        }
    })
}

/// A CSP hash source: `sha256-<base64 of the digest>`.
fn sha256(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    format!(
        "sha256-{}",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

/// `GET /ui`.
pub fn page() -> (Response<Full<Bytes>>, &'static str) {
    let page = built();
    let resp = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/html; charset=utf-8")
        .header(header::CONTENT_SECURITY_POLICY, page.csp.clone())
        .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff")
        .header(header::X_FRAME_OPTIONS, "DENY")
        .header(header::REFERRER_POLICY, "no-referrer")
        // A kept copy could outlive an upgrade of the router it talks to.
        .header(header::CACHE_CONTROL, "no-store")
        .body(Full::new(page.body.clone()))
        .expect("static response");
    (resp, "ok")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::routes::Route;

    #[test]
    fn only_marked_reads_are_polls() {
        let mut marked = http::HeaderMap::new();
        marked.insert(POLL_HEADER, HeaderValue::from_static("1"));
        let plain = http::HeaderMap::new();
        let get = http::Method::GET;
        assert!(is_poll(&get, Some(Route::Metrics), &marked));
        assert!(is_poll(&get, Some(Route::AdminLocks), &marked));
        assert!(!is_poll(&get, Some(Route::Metrics), &plain));
        assert!(!is_poll(&get, None, &marked));
        let post = http::Method::POST;
        assert!(!is_poll(&post, Some(Route::AdminForceRelease), &marked));
        assert!(!is_poll(&post, Some(Route::Acquire), &marked));
    }

    #[test]
    fn the_policy_admits_exactly_the_inline_script_and_style() {
        let page = built();
        let body = std::str::from_utf8(&page.body).unwrap();
        let csp = page.csp.to_str().unwrap();
        assert!(!body.contains("{{"), "a placeholder left in the page");
        for (tag, text) in [("script", SCRIPT), ("style", STYLE)] {
            assert!(!text.contains(&format!("</{tag}")), "{tag} closes its tag");
            assert_eq!(body.matches(&format!("<{tag}>")).count(), 1, "one {tag}");
            assert!(body.contains(&format!("<{tag}>{text}</{tag}>")));
            assert!(
                csp.contains(&format!("{tag}-src '{}'", sha256(text))),
                "{csp}"
            );
        }
        assert!(csp.starts_with("default-src 'none';"));
    }
}
