//! The data layout on each shard, below the configured prefix `P`:
//!
//! - `P/ring` holds the [`RingMeta`] (epoch and ring fingerprint) that every
//!   acquire compares byte for byte.
//! - `P/locks/<hex of the first 16 bytes of SHA-256(name)>` is a held lock,
//!   attached to its session lease, with a [`LockValue`] naming the holder.
//!   Hashing bounds key size and keeps lockIds short; a collision could only
//!   make two names exclude each other (safe), never grant one name twice.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::ring::hex;

/// The first 16 bytes of SHA-256 of a lock name.
pub type NameHash = [u8; 16];

pub fn name_hash(name: &str) -> NameHash {
    let digest = Sha256::digest(name.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&digest[..16]);
    out
}

/// Key names on one shard.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
        }
    }

    pub fn ring(&self) -> Vec<u8> {
        format!("{}/ring", self.prefix).into_bytes()
    }

    pub fn lock(&self, hash: &NameHash) -> Vec<u8> {
        format!("{}/locks/{}", self.prefix, hex(hash)).into_bytes()
    }

    /// Start and end (exclusive) of the range holding every lock key.
    pub fn locks_range(&self) -> (Vec<u8>, Vec<u8>) {
        (
            format!("{}/locks/", self.prefix).into_bytes(),
            format!("{}/locks0", self.prefix).into_bytes(), // '0' follows '/'
        )
    }
}

/// Value of a lock key: who holds it and in which ring epoch it was granted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LockValue {
    pub client: String,
    pub epoch: u64,
    pub name: String,
}

/// Value of the ring key. Serialised deterministically, so equal metas are
/// equal bytes and an acquire can compare them inside its txn.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RingMeta {
    pub epoch: u64,
    pub ring: String,
}

impl RingMeta {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("RingMeta serialises")
    }
}
