//! The fence table's hash of a `(session, batch)` key: SipHash-1-3 — what
//! std's `HashMap` uses, keyed at random, so a peer that picks its batch ids
//! cannot aim them at one bucket — computed over the key's two words
//! directly.
//!
//! Through `RandomState::hash_one` the same hash cost ~200 instructions per
//! write on the target: std's `DefaultHasher` only has a byte-slice `write`,
//! so each `u64` went through its buffering of partial words. Two words
//! need none of it: two compression rounds, the length block, three
//! finalisation rounds.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// SipHash-1-3 keys, drawn at random per table.
#[derive(Clone, Copy)]
pub(crate) struct BatchHash {
    k0: u64,
    k1: u64,
}

impl Default for BatchHash {
    /// Random keys: two hashes of std's randomly keyed SipHash.
    fn default() -> Self {
        let random = RandomState::new();
        BatchHash {
            k0: random.hash_one(0u64),
            k1: random.hash_one(1u64),
        }
    }
}

impl BatchHash {
    #[cfg(test)]
    fn with_keys(k0: u64, k1: u64) -> Self {
        BatchHash { k0, k1 }
    }

    /// The hash of the 16-byte message `a` then `b`, both little-endian.
    #[inline]
    pub(crate) fn hash(&self, a: u64, b: u64) -> u64 {
        let mut v = [
            self.k0 ^ 0x736f_6d65_7073_6575,
            self.k1 ^ 0x646f_7261_6e64_6f6d,
            self.k0 ^ 0x6c79_6765_6e65_7261,
            self.k1 ^ 0x7465_6462_7974_6573,
        ];
        // The message's words, then the length block (16 bytes, no tail).
        for m in [a, b, 16u64 << 56] {
            v[3] ^= m;
            round(&mut v);
            v[0] ^= m;
        }
        v[2] ^= 0xff;
        round(&mut v);
        round(&mut v);
        round(&mut v);
        v[0] ^ v[1] ^ v[2] ^ v[3]
    }
}

#[inline(always)]
fn round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{DefaultHasher, Hasher};

    /// std's `DefaultHasher::new()` is SipHash-1-3 with zero keys (as it
    /// has been since Rust 1.13; were that to change, this test says so).
    #[test]
    fn it_is_sip_hash_1_3_of_the_two_words() {
        let keyed = BatchHash::with_keys(0, 0);
        for (a, b) in [
            (0u64, 0u64),
            (1, 2),
            (u64::MAX, 7),
            (0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210),
        ] {
            let mut std = DefaultHasher::new();
            std.write(&a.to_le_bytes());
            std.write(&b.to_le_bytes());
            assert_eq!(keyed.hash(a, b), std.finish(), "({a:#x}, {b:#x})");
        }
    }

    #[test]
    fn keys_are_drawn_per_table_and_change_the_hash() {
        let (x, y) = (BatchHash::default(), BatchHash::default());
        assert_ne!((x.k0, x.k1), (y.k0, y.k1));
        assert_ne!(x.hash(1, 2), y.hash(1, 2));
        assert_ne!(x.hash(1, 2), x.hash(2, 1));
    }
}
