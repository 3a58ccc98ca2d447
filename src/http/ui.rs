//! The status page served at `/ui`: one HTML document (`ui.html`) with its
//! style (`ui.css`) and script (`ui.js`) inline, built into the binary. The
//! script reads the router's own routes from the browser and nothing from
//! elsewhere. The page's Content-Security-Policy admits that script and
//! style by their SHA-256 and nothing else, so no other script runs in it,
//! not even one injected through an answer it renders, and it may fetch
//! from its own origin only.

use std::sync::OnceLock;

use base64::Engine;
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use sha2::{Digest, Sha256};

const HTML: &str = include_str!("ui.html");
const STYLE: &str = include_str!("ui.css");
const SCRIPT: &str = include_str!("ui.js");

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
