//! Lease tags: 24 bits naming a principal in the etcd lease ids of its
//! session leases (etcd lets the client choose a lease's id), so that
//! whoever sees a lock key's lease knows whose it is: every replica's
//! lock-key cache counts each principal's locks and sessions from the
//! lease ids alone, for per-principal quotas. Pure functions; no I/O.

/// 24 bits naming a principal in its session leases' ids: the first bits
/// of SHA-256 of its name. Two principals may share a tag (they then share
/// their counts, which errs towards refusing); the config refuses it for
/// principals with quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseTag(u32);

/// Bits of a tagged lease id below the tag: random, so ids of one
/// principal do not collide (etcd refuses an id in use).
const TAG_SHIFT: u32 = 39;

impl LeaseTag {
    pub fn of(principal: &str) -> Self {
        use sha2::{Digest, Sha256};
        let d = Sha256::digest(principal.as_bytes());
        Self(u32::from_be_bytes([0, d[0], d[1], d[2]]))
    }

    /// The tag a lease id carries (meaningful only for tagged ids).
    pub fn in_lease(id: i64) -> Self {
        Self(((id as u64) >> TAG_SHIFT) as u32 & 0xff_ffff)
    }

    /// A new random lease id with this tag: positive, non-zero.
    pub fn new_lease_id(self) -> i64 {
        let low = rand::random::<u64>() & ((1 << TAG_SHIFT) - 1);
        ((u64::from(self.0) << TAG_SHIFT) | low.max(1)) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_ids_are_positive_and_carry_their_tag() {
        for name in [
            "payments",
            "ship",
            "",
            "a-very-long-principal-name-0123456789",
        ] {
            let tag = LeaseTag::of(name);
            for _ in 0..100 {
                let id = tag.new_lease_id();
                assert!(id > 0, "{id}");
                assert_eq!(LeaseTag::in_lease(id), tag);
            }
        }
        assert_ne!(LeaseTag::of("payments"), LeaseTag::of("shipping"));
        assert_ne!(
            LeaseTag::of("p").new_lease_id(),
            LeaseTag::of("p").new_lease_id()
        );
    }
}
