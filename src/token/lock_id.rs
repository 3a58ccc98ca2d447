//! lockIds: self-describing, so any router replica can renew or release a
//! lock with no local state.
//!
//! Layout (then base64url without padding, at most 144 characters):
//! `version u8 | epoch u16 | ttl_secs u32 | lease i64 | revision i64 |
//! name hash [16] | shard len u8 | shard | checksum [4]` (integers big-endian;
//! the checksum is the first 4 bytes of SHA-256 of everything before it).
//! The checksum only catches corruption and casual edits; safety rests on the
//! etcd txns, which act only when the key still has this create revision and
//! this lease.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::token::fencing;

/// The first 16 bytes of SHA-256 of a lock name (see the key layout).
pub type NameHash = [u8; 16];

const VERSION: u8 = 1;
const FIXED_LEN: usize = 1 + 2 + 4 + 8 + 8 + 16 + 1;
const CHECKSUM_LEN: usize = 4;

/// Everything needed to find and act on one grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockId {
    pub shard: String,
    /// Ring epoch the grant was made in (the token's high bits).
    pub epoch: u16,
    /// TTL of the session lease the lock rides on, in whole seconds.
    pub ttl_secs: u32,
    pub lease: i64,
    /// Create revision of the lock key (the token's low bits).
    pub revision: i64,
    pub name_hash: NameHash,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("lockId is malformed or was altered")]
pub struct BadLockId;

impl LockId {
    pub fn token(&self) -> Option<u64> {
        fencing::token(self.epoch.into(), self.revision)
    }

    pub fn encode(&self) -> String {
        let mut b = Vec::with_capacity(FIXED_LEN + self.shard.len() + CHECKSUM_LEN);
        b.push(VERSION);
        b.extend_from_slice(&self.epoch.to_be_bytes());
        b.extend_from_slice(&self.ttl_secs.to_be_bytes());
        b.extend_from_slice(&self.lease.to_be_bytes());
        b.extend_from_slice(&self.revision.to_be_bytes());
        b.extend_from_slice(&self.name_hash);
        b.push(self.shard.len() as u8);
        b.extend_from_slice(self.shard.as_bytes());
        let sum = Sha256::digest(&b);
        b.extend_from_slice(&sum[..CHECKSUM_LEN]);
        URL_SAFE_NO_PAD.encode(b)
    }

    pub fn decode(s: &str) -> Result<Self, BadLockId> {
        if s.len() > 512 {
            return Err(BadLockId);
        }
        let b = URL_SAFE_NO_PAD.decode(s).map_err(|_| BadLockId)?;
        if b.len() < FIXED_LEN + 1 + CHECKSUM_LEN || b[0] != VERSION {
            return Err(BadLockId);
        }
        let (body, sum) = b.split_at(b.len() - CHECKSUM_LEN);
        if Sha256::digest(body)[..CHECKSUM_LEN] != *sum {
            return Err(BadLockId);
        }
        let shard_len = body[FIXED_LEN - 1] as usize;
        if body.len() != FIXED_LEN + shard_len {
            return Err(BadLockId);
        }
        let shard = std::str::from_utf8(&body[FIXED_LEN..]).map_err(|_| BadLockId)?;
        let id = LockId {
            shard: shard.to_string(),
            epoch: u16::from_be_bytes(body[1..3].try_into().map_err(|_| BadLockId)?),
            ttl_secs: u32::from_be_bytes(body[3..7].try_into().map_err(|_| BadLockId)?),
            lease: i64::from_be_bytes(body[7..15].try_into().map_err(|_| BadLockId)?),
            revision: i64::from_be_bytes(body[15..23].try_into().map_err(|_| BadLockId)?),
            name_hash: body[23..39].try_into().map_err(|_| BadLockId)?,
        };
        id.token().ok_or(BadLockId)?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LockId {
        LockId {
            shard: "shard-b".into(),
            epoch: 3,
            ttl_secs: 30,
            lease: 0x1234_5678_9abc,
            revision: 4711,
            name_hash: crate::shard::keys::name_hash("process_order:42"),
        }
    }

    #[test]
    fn round_trips_and_is_url_safe() {
        let s = sample().encode();
        assert!(s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert!(s.len() <= 512);
        assert_eq!(LockId::decode(&s).unwrap(), sample());
    }

    #[test]
    fn any_altered_character_is_rejected() {
        let s = sample().encode();
        for i in 0..s.len() {
            let mut chars: Vec<char> = s.chars().collect();
            chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
            let altered: String = chars.into_iter().collect();
            // The last character may carry only padding bits, which base64
            // decoders may ignore; everything else must be caught.
            if let Ok(id) = LockId::decode(&altered) {
                assert_eq!(id, sample(), "altered id at {i} decoded differently");
            }
        }
        for bad in ["", "!!!", "AAAA", &"A".repeat(600), &s[..s.len() - 3]] {
            assert_eq!(LockId::decode(bad), Err(BadLockId), "{bad:?}");
        }
    }
}
