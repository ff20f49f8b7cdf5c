//! The segments a target serves, indexed by what a proof may name them by:
//! id, name, or an address inside one. A peer that has proved nothing may
//! send thousands of proofs in one `Auth`; each finds its segments by an
//! index, not by a walk over every segment served (which let one
//! unauthenticated frame cost proofs × segments comparisons, uncounted by
//! the HMAC budget).
//!
//! Addresses: segments are kept by base in 64 classes of length (class k
//! holds lengths of k + 1 significant bits). A segment of class k holding
//! an address has its base at most 2^(k+1) − 2 below it, and segments that
//! do not overlap put at most two bases of one class in that window: a
//! lookup reads a few entries of each class in use, however many segments
//! there are and however long the longest (a bound by the longest alone
//! made one long segment turn the lookup back into a walk over the short
//! ones below the address).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::segment::Segment;

/// Classes of length: 1 ..= u64::MAX bytes, by significant bits.
const CLASSES: usize = 64;

/// The live segments of one target.
pub(crate) struct Registered {
    by_id: BTreeMap<u64, Segment>,
    by_name: HashMap<Box<str>, u64>,
    /// (base, id) of every segment of nonzero length, by its length's class.
    by_base: Vec<BTreeSet<(u64, u64)>>,
    /// Bit k set while class k holds a segment.
    classes: u64,
}

impl Default for Registered {
    fn default() -> Self {
        Registered {
            by_id: BTreeMap::new(),
            by_name: HashMap::new(),
            by_base: (0..CLASSES).map(|_| BTreeSet::new()).collect(),
            classes: 0,
        }
    }
}

/// The class of a nonzero length: its significant bits, less one.
fn class(len: u64) -> usize {
    (63 - len.leading_zeros()) as usize
}

impl Registered {
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn get(&self, id: u64) -> Option<&Segment> {
        self.by_id.get(&id)
    }

    /// The segment registered as `name`.
    pub(crate) fn named(&self, name: &str) -> Option<&Segment> {
        self.by_name.get(name).and_then(|id| self.by_id.get(id))
    }

    pub(crate) fn has_name(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Adds `seg`, whose name no live segment has (checked by the caller).
    pub(crate) fn insert(&mut self, seg: Segment) {
        debug_assert!(!self.has_name(seg.name()));
        self.by_name.insert(seg.name().into(), seg.id());
        if !seg.is_empty() {
            let k = class(seg.len());
            self.by_base[k].insert((seg.base(), seg.id()));
            self.classes |= 1 << k;
        }
        self.by_id.insert(seg.id(), seg);
    }

    pub(crate) fn remove(&mut self, id: u64) -> Option<Segment> {
        let seg = self.by_id.remove(&id)?;
        self.by_name.remove(seg.name());
        if !seg.is_empty() {
            let k = class(seg.len());
            self.by_base[k].remove(&(seg.base(), id));
            if self.by_base[k].is_empty() {
                self.classes &= !(1 << k);
            }
        }
        Some(seg)
    }

    /// Every live segment, by id.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Segment> {
        self.by_id.values()
    }

    /// The segments holding address `a` (segments may overlap).
    pub(crate) fn holding(&self, a: u64) -> impl Iterator<Item = &Segment> {
        let classes = self.classes;
        (0..CLASSES)
            .filter(move |k| classes & (1 << k) != 0)
            .flat_map(move |k| {
                // Class k's longest is 2^(k+1) − 1 bytes.
                let longest = u64::MAX >> (63 - k);
                let from = a.saturating_sub(longest - 1);
                self.by_base[k].range((from, 0)..=(a, u64::MAX))
            })
            .filter_map(|(_, id)| self.by_id.get(id))
            .filter(move |s| a.checked_sub(s.base()).is_some_and(|o| o < s.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::ForeignMemory;
    use crate::segment::ExposedSegments;
    use crate::{Rights, Token};
    use std::rc::Rc;

    fn seg(id: u64, name: &str, mem: &'static mut [u8]) -> Segment {
        let exposed = Rc::new(ExposedSegments::default());
        // SAFETY: leaked memory, valid for ever; this test writes none of it.
        let mem = unsafe { ForeignMemory::new(mem.as_mut_ptr(), mem.len(), || {}) };
        Segment::new(
            id,
            name.into(),
            mem.into(),
            Rights::READ,
            Token::random(),
            &exposed,
        )
    }

    #[test]
    fn addresses_find_every_segment_holding_them_and_no_other() {
        let big: &'static mut [u8] = Box::leak(vec![0u8; 1 << 16].into_boxed_slice());
        let base = big.as_ptr() as u64;
        let (head, tail) = big.split_at_mut(4096);
        let mut r = Registered::default();
        r.insert(seg(1, "head", head));
        r.insert(seg(2, "tail", tail));
        let ids = |r: &Registered, a| r.holding(a).map(Segment::id).collect::<Vec<_>>();
        assert_eq!(ids(&r, base), [1]);
        assert_eq!(ids(&r, base + 4095), [1]);
        assert_eq!(ids(&r, base + 4096), [2]);
        assert_eq!(ids(&r, base + (1 << 16) - 1), [2]);
        assert!(ids(&r, base + (1 << 16)).is_empty());
        assert!(ids(&r, base.wrapping_sub(1)).is_empty());
        assert!(ids(&r, 0).is_empty() && ids(&r, u64::MAX).is_empty());
        assert_eq!(r.named("tail").map(Segment::id), Some(2));
        let gone = r.remove(2).unwrap();
        assert_eq!(gone.id(), 2);
        assert!(ids(&r, base + 4096).is_empty() && r.named("tail").is_none());
        assert_eq!((r.len(), r.has_name("head")), (1, true));
    }

    #[test]
    fn classes_of_length_split_where_their_bits_do() {
        assert_eq!((class(1), class(2), class(3), class(4)), (0, 1, 1, 2));
        assert_eq!((class(4095), class(4096), class(u64::MAX)), (11, 12, 63));
    }
}
