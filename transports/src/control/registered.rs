//! The segments a target serves, indexed by what a proof may name them by:
//! id, name, or an address inside one. A peer that has proved nothing may
//! send thousands of proofs in one `Auth`; each finds its segments by an
//! index, not by a walk over every segment served (which let one
//! unauthenticated frame cost proofs × segments comparisons, uncounted by
//! the HMAC budget).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::segment::Segment;

/// The live segments of one target.
#[derive(Default)]
pub(crate) struct Registered {
    by_id: BTreeMap<u64, Segment>,
    by_name: HashMap<Box<str>, u64>,
    /// (base, id) of every segment.
    by_base: BTreeSet<(u64, u64)>,
    /// The longest segment's length: only a segment based at most this far
    /// below an address can hold it. Not lowered when that segment goes
    /// (a wider search finds the same segments).
    longest: u64,
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
        self.by_base.insert((seg.base(), seg.id()));
        self.longest = self.longest.max(seg.len());
        self.by_id.insert(seg.id(), seg);
    }

    pub(crate) fn remove(&mut self, id: u64) -> Option<Segment> {
        let seg = self.by_id.remove(&id)?;
        self.by_name.remove(seg.name());
        self.by_base.remove(&(seg.base(), id));
        Some(seg)
    }

    /// Every live segment, by id.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Segment> {
        self.by_id.values()
    }

    /// The segments holding address `a` (segments may overlap), by base.
    pub(crate) fn holding(&self, a: u64) -> impl Iterator<Item = &Segment> {
        let from = match self.longest {
            0 => a.saturating_add(1).max(1),
            n => a.saturating_sub(n - 1),
        };
        let found = match from <= a {
            true => Some(self.by_base.range((from, 0)..=(a, u64::MAX))),
            false => None,
        };
        found
            .into_iter()
            .flatten()
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
}
