//! The ring: which shard owns a lock name.
//!
//! Consistent hashing (`hashring`) over virtual nodes, hashed with SipHash-1-3
//! under fixed keys and fed only explicit bytes, so placement is identical in
//! every process, on every platform and with every Rust release. Two replicas
//! that disagreed on placement could grant one name on two shards, so the
//! ring also has a fingerprint of everything that decides placement; each
//! shard records it, and acquires compare it (see `shard.rs`).

use std::hash::{BuildHasher, Hash, Hasher};

use hashring::HashRing;
use sha2::{Digest, Sha256};
use siphasher::sip::SipHasher13;

use crate::config::ShardSettings;

/// Fixed SipHash keys: changing them moves every name, so they never change.
const SIP_K0: u64 = 0x6c6f_636b_726f_7574; // "lockrout"
const SIP_K1: u64 = 0x6572_2d72_696e_6731; // "er-ring1"

/// A `BuildHasher` whose output depends only on the bytes written.
#[derive(Clone, Copy, Debug, Default)]
pub struct PlacementHash;

impl BuildHasher for PlacementHash {
    type Hasher = SipHasher13;
    fn build_hasher(&self) -> SipHasher13 {
        SipHasher13::new_with_keys(SIP_K0, SIP_K1)
    }
}

/// One virtual node: hashed as `"<shard>#<i>"`, never through `Hash` of
/// integers (whose bytes depend on the platform's endianness).
#[derive(Clone, Debug)]
struct VNode {
    shard: usize,
    label: Vec<u8>,
}

impl Hash for VNode {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.label);
    }
}

/// A lock name as the ring sees it: its UTF-8 bytes.
struct NameBytes<'a>(&'a [u8]);

impl Hash for NameBytes<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.0);
    }
}

/// Placement of names on shards.
pub struct Ring {
    ring: HashRing<VNode, PlacementHash>,
    /// Shard names in config order; `VNode::shard` indexes this.
    shards: Vec<String>,
    /// Hex digest of what decides placement (names, weights, vnodes, hash).
    fingerprint: String,
}

/// Most virtual nodes a ring may have (config allows at most 10,000 vnodes
/// per unit of weight and weights up to 1,000, but far fewer shards).
const MAX_VNODES: u64 = 20_000_000;

impl Ring {
    /// A ring over validated settings (the config checks them at load).
    pub fn new(shards: &[ShardSettings], vnodes: u32) -> Self {
        Self::try_new(shards, vnodes).expect("validated settings make a ring")
    }

    /// A ring over settings that may come from anywhere (a previous ring
    /// recorded on a shard is input, not trusted config): no shards, a
    /// duplicate name or too many virtual nodes is an error, not a panic.
    pub fn try_new(shards: &[ShardSettings], vnodes: u32) -> Result<Self, String> {
        if shards.is_empty() {
            return Err("a ring needs at least one shard".into());
        }
        let mut total: u64 = 0;
        for (i, s) in shards.iter().enumerate() {
            if s.weight == 0 || vnodes == 0 {
                return Err(format!("shard {:?} has no virtual nodes", s.name));
            }
            if shards[..i].iter().any(|o| o.name == s.name) {
                return Err(format!("shard {:?} appears twice", s.name));
            }
            total += u64::from(vnodes) * u64::from(s.weight);
        }
        if total > MAX_VNODES {
            return Err(format!("{total} virtual nodes is more than {MAX_VNODES}"));
        }
        Ok(Self::build(shards, vnodes))
    }

    fn build(shards: &[ShardSettings], vnodes: u32) -> Self {
        let mut ring = HashRing::with_hasher(PlacementHash);
        let mut nodes = Vec::new();
        for (idx, s) in shards.iter().enumerate() {
            for i in 0..u64::from(vnodes) * u64::from(s.weight) {
                let label = format!("{}#{i}", s.name).into_bytes();
                nodes.push(VNode { shard: idx, label });
            }
        }
        // One sort for all nodes (adding them one by one sorts each time).
        ring.batch_add(nodes);
        Self {
            ring,
            shards: shards.iter().map(|s| s.name.clone()).collect(),
            fingerprint: fingerprint(shards, vnodes),
        }
    }

    /// Index (into the configured shard list) of the shard owning `name`.
    pub fn shard_index(&self, name: &str) -> usize {
        self.ring
            .get(&NameBytes(name.as_bytes()))
            .map(|v| v.shard)
            .expect("a ring is built from at least one shard")
    }

    pub fn shard_name(&self, name: &str) -> &str {
        &self.shards[self.shard_index(name)]
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

fn fingerprint(shards: &[ShardSettings], vnodes: u32) -> String {
    let mut parts: Vec<(&str, u32)> = shards.iter().map(|s| (s.name.as_str(), s.weight)).collect();
    parts.sort();
    let mut h = Sha256::new();
    h.update(format!("lockrouter-ring-v1;siphash13;vnodes={vnodes}").as_bytes());
    for (name, weight) in parts {
        h.update(format!(";{name}={weight}").as_bytes());
    }
    hex::encode(&h.finalize()[..12])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(names: &[&str]) -> Vec<ShardSettings> {
        names
            .iter()
            .map(|n| ShardSettings {
                name: n.to_string(),
                endpoints: vec!["http://127.0.0.1:2379".into()],
                weight: 1,
                ..ShardSettings::default()
            })
            .collect()
    }

    #[test]
    fn placement_is_pinned() {
        // If this test fails, placement changed: every deployed name would
        // move without a rebalance. Never update these values casually.
        let ring = Ring::new(&shards(&["a", "b", "c"]), 160);
        let got: Vec<&str> = ["process_order:42", "batch:7", "tonight", "x", "日本"]
            .iter()
            .map(|n| ring.shard_name(n))
            .collect();
        assert_eq!(got, PINNED);
        assert_eq!(ring.fingerprint(), PINNED_FINGERPRINT);
    }
    const PINNED: [&str; 5] = ["c", "a", "b", "b", "b"];
    const PINNED_FINGERPRINT: &str = "79e3bc25da5afb7458ffdef8";

    #[test]
    fn adding_a_shard_moves_names_only_onto_it() {
        // What a migration relies on: a name either stays where it was or
        // moves to the new shard, never between two old ones.
        let before = Ring::new(&shards(&["a", "b", "c"]), 160);
        let after = Ring::new(&shards(&["a", "b", "c", "d"]), 160);
        let mut moved = 0;
        for i in 0..10_000 {
            let n = format!("name-{i}");
            let (old, new) = (before.shard_name(&n), after.shard_name(&n));
            if old != new {
                assert_eq!(new, "d", "{n} moved from {old} to {new}");
                moved += 1;
            }
        }
        // About a quarter of the names move: no more than consistent
        // hashing needs.
        assert!((1_800..3_200).contains(&moved), "{moved} of 10000 moved");
    }

    #[test]
    fn config_order_does_not_matter() {
        let a = Ring::new(&shards(&["a", "b", "c"]), 160);
        let b = Ring::new(&shards(&["c", "a", "b"]), 160);
        assert_eq!(a.fingerprint(), b.fingerprint());
        for i in 0..1_000 {
            let n = format!("name-{i}");
            assert_eq!(a.shard_name(&n), b.shard_name(&n));
        }
    }

    #[test]
    fn three_shards_get_a_third_each() {
        let ring = Ring::new(&shards(&["a", "b", "c"]), 160);
        let mut counts = [0usize; 3];
        let n = 60_000;
        // Deterministic pseudo-random names (an LCG) so the test is repeatable.
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..n {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            counts[ring.shard_index(&format!("job:{x:x}"))] += 1;
        }
        for c in counts {
            let share = c as f64 / n as f64;
            assert!(
                (share - 1.0 / 3.0).abs() < 0.05,
                "share {share} in {counts:?}"
            );
        }
    }

    #[test]
    fn rings_from_recorded_data_are_validated_not_trusted() {
        assert!(Ring::try_new(&[], 160).is_err());
        assert!(Ring::try_new(&shards(&["a", "a"]), 160).is_err());
        let mut heavy = shards(&["a"]);
        heavy[0].weight = u32::MAX;
        assert!(
            Ring::try_new(&heavy, u32::MAX).is_err(),
            "no overflow, no panic"
        );
        assert!(Ring::try_new(&shards(&["a"]), 0).is_err());
        assert_eq!(
            Ring::try_new(&shards(&["a", "b"]), 160)
                .unwrap()
                .fingerprint(),
            Ring::new(&shards(&["a", "b"]), 160).fingerprint()
        );
    }

    #[test]
    fn weight_changes_the_fingerprint() {
        let mut s = shards(&["a", "b"]);
        let before = Ring::new(&s, 160).fingerprint().to_string();
        s[1].weight = 2;
        assert_ne!(before, Ring::new(&s, 160).fingerprint());
        assert_ne!(before, Ring::new(&shards(&["a", "b"]), 100).fingerprint());
    }
}
