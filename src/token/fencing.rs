//! Fencing tokens: `epoch << 47 | create_revision`.
//!
//! Revisions are per etcd cluster, so a revision alone cannot stay monotonic
//! when a name moves between shards; the ring epoch in the high bits makes
//! every grant of a newer epoch larger than every grant of an older one.
//! 16 bits of epoch and 47 bits of revision keep tokens below 2^63 (a signed
//! 64-bit integer); 2^47 revisions last over 400 years at 10K writes/s.

/// Bits of the token that hold the etcd create revision.
pub const REVISION_BITS: u32 = 47;
/// Largest ring epoch a token can carry.
pub const MAX_EPOCH: u64 = (1 << 16) - 1;
const REVISION_MASK: u64 = (1 << REVISION_BITS) - 1;

/// The token of a grant made in `epoch` at etcd `revision`, or `None` if
/// either part is out of range (which would break monotonicity).
pub fn token(epoch: u64, revision: i64) -> Option<u64> {
    let rev = u64::try_from(revision).ok()?;
    if epoch > MAX_EPOCH || rev > REVISION_MASK || rev == 0 {
        return None;
    }
    Some(epoch << REVISION_BITS | rev)
}

/// Splits a token into `(epoch, revision)`.
pub fn split(token: u64) -> (u64, i64) {
    (token >> REVISION_BITS, (token & REVISION_MASK) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_epoch_beats_any_revision() {
        let old = token(1, REVISION_MASK as i64).unwrap();
        let new = token(2, 1).unwrap();
        assert!(new > old);
    }

    #[test]
    fn tokens_fit_in_i64_and_round_trip() {
        let t = token(MAX_EPOCH, REVISION_MASK as i64).unwrap();
        assert!(t <= i64::MAX as u64);
        assert_eq!(split(token(7, 4711).unwrap()), (7, 4711));
        assert_eq!(token(MAX_EPOCH + 1, 1), None);
        assert_eq!(token(1, 0), None);
        assert_eq!(token(1, -1), None);
    }
}
