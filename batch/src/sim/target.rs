//! The simulated targets' memory: where a write's bytes land, and when the
//! residue of a lost one does.

use super::Inner;

/// A write's bytes landing at its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landing {
    /// The target.
    pub peer: usize,
    /// The wire batch the bytes were sent in.
    pub wire: u64,
    /// The source buffer's address.
    pub addr: usize,
    /// The simulated clock.
    pub at: u64,
    /// Residue of a lost transfer, landing after it ended.
    pub late: bool,
}

/// Residue waiting in a target's kernel.
pub(super) struct Residue {
    pub(super) peer: usize,
    pub(super) wire: u64,
    pub(super) addr: usize,
    pub(super) due: u64,
}

/// One tick of the clock: residue that is due lands, unless its wire batch
/// was fenced there (the target discards it) or the peer revoked the grant
/// it was written under (refused).
pub(super) fn tick(inner: &Inner) {
    let now = inner.clock.get() + 1;
    inner.clock.set(now);
    let due: Vec<Residue> = {
        let mut r = inner.residue.borrow_mut();
        let (due, keep) = std::mem::take(&mut *r)
            .into_iter()
            .partition(|x| x.due <= now);
        *r = keep;
        due
    };
    for x in due {
        let fenced = inner.fenced.borrow().contains(&(x.peer, x.wire));
        if !fenced && !inner.revoked.borrow()[x.peer] {
            land(inner, x.peer, x.wire, x.addr, true);
        }
    }
}

/// Records bytes of `wire` from `addr` landing at `peer` now.
pub(super) fn land(inner: &Inner, peer: usize, wire: u64, addr: usize, late: bool) {
    let at = inner.clock.get();
    let mut log = inner.log.borrow_mut();
    if inner.revoke_done.borrow()[peer] {
        log.landed_after_revoke += 1;
    }
    log.landings.push(Landing {
        peer,
        wire,
        addr,
        at,
        late,
    });
}
