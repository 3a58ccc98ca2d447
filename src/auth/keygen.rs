//! New bearer tokens and lockId keys, for `lockrouter auth new-token` and
//! `new-key`: 32 bytes of the system's random source each.

use sha2::{Digest, Sha256};

/// A new random bearer token and its SHA-256 (hex), for `token_sha256`.
pub fn new_token() -> (String, String) {
    use base64::Engine;
    let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes());
    let hash = hex::encode(Sha256::digest(token.as_bytes()));
    (token, hash)
}

/// A new random lockId key, base64 as `auth.lock_id_keys` takes it.
pub fn new_key() -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(random_bytes())
}

fn random_bytes() -> [u8; 32] {
    let mut b = [0u8; 32];
    rustls::crypto::aws_lc_rs::default_provider()
        .secure_random
        .fill(&mut b)
        .expect("the system's random source works");
    b
}
