//! Maps keyed by ids this process hands out itself — the initiator's
//! request ids and wire batch ids, the target's segment ids — sequential
//! and never chosen by a peer. SipHash's resistance to chosen keys buys
//! nothing there and costs ~50–200 instructions per lookup, several lookups
//! per request; a multiplicative hash spreads sequential ids over both the
//! bucket bits and the tag bits. A peer may *look up* any key (a miss costs
//! one probe sequence); only keys a peer could *insert* need SipHash, so
//! never for keys a peer picks.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Fibonacci hashing of one `u64`.
#[derive(Default, Clone, Copy)]
pub(crate) struct OwnIdHasher(u64);

const K: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for OwnIdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(K);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(K);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by this process's own ids.
pub(crate) type OwnIdMap<V> = HashMap<u64, V, BuildHasherDefault<OwnIdHasher>>;

/// A set of this process's own ids.
pub(crate) type OwnIdSet = HashSet<u64, BuildHasherDefault<OwnIdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_land_in_distinct_buckets_and_tags() {
        use std::hash::BuildHasher;
        let b = BuildHasherDefault::<OwnIdHasher>::default();
        let hashes: Vec<u64> = (1..=1024u64).map(|i| b.hash_one(i)).collect();
        // Low 10 bits (the bucket of a 1024-slot table): all distinct.
        let low: HashSet<u64> = hashes.iter().map(|h| h & 1023).collect();
        assert_eq!(low.len(), 1024);
        // Top 7 bits (the tag): spread over most of the 128 values.
        let tags: HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        assert!(tags.len() > 100, "{} tags", tags.len());
        let mut m = OwnIdMap::default();
        for i in 0..10_000u64 {
            m.insert(i, i * 2);
        }
        assert!((0..10_000u64).all(|i| m[&i] == i * 2));
    }
}
