//! Which posted work requests ask for a completion, and what each completion
//! accounts for.
//!
//! A transfer's requests are posted unsignalled except the last of each run
//! of its requests in one doorbell (the last of a doorbell is always
//! signalled, so the send queue never fills with requests nothing would
//! free). Such a run is a [`Group`]; its signalled request's `wr_id` carries
//! [`SIGNALLED`].
//!
//! The invariant the reaper relies on: **a group is retired only when the
//! completion of its signalled request is reaped**, success or not. An RC
//! send queue completes in order, so by then every earlier request of the
//! link is done too: its own silent successes and any of its errors, which
//! verbs reports as completions of their own whether signalled or not. Those
//! error completions carry the transfer's error and account for nothing.
//!
//! The one group without a signalled request is the part of a doorbell that
//! was posted before `ibv_post_send` refused the rest. The queue pair is
//! moved to the error state, but those of its requests the NIC finished
//! before that completed silently, so their number is unknown: the reaper
//! then posts a **marker** — one signalled request of the same transfer,
//! which the errored queue pair flushes after every earlier one — and its
//! completion retires the group as a signalled request's does
//! ([`Ledger::close_cut`]). Only when the marker cannot be posted is the
//! group retired by counting its flushes, which stays short (and the
//! transfer unresolved, its buffer kept) if any of them had completed.

use std::collections::VecDeque;

use super::verbs::{WorkRequest, SIGNALLED};

/// A run of one transfer's requests posted together (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    /// The transfer's `wr_id`, without [`SIGNALLED`].
    wr_id: u64,
    /// Requests in the run.
    requests: u32,
    /// Whether the last of them was posted signalled, or a marker after
    /// them.
    signalled: bool,
    /// Whether a marker request follows them (one more send queue entry).
    marker: bool,
    /// Completions of the run reaped so far (errors, or flushes).
    seen: u32,
    /// Bytes its requests move.
    bytes: u64,
}

/// What one reaped completion retires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Retired {
    /// The transfer's `wr_id`, without [`SIGNALLED`].
    pub(crate) wr_id: u64,
    /// Posted requests of it now known to be done (0: the completion only
    /// carries an error; the group is retired by a later one).
    pub(crate) requests: u32,
    /// Send queue entries (and completion queue room) they held: the
    /// requests, and the marker of a cut group.
    pub(crate) entries: u32,
    /// Bytes those requests move (landed, if the completion is a success).
    pub(crate) bytes: u64,
}

/// One link's posted groups, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    groups: VecDeque<Group>,
}

impl Ledger {
    /// Marks which of `wrs`, about to be posted in one doorbell, ask for a
    /// completion: the last of each transfer's run, and the last of all.
    pub(crate) fn mark(wrs: &mut [WorkRequest]) {
        let n = wrs.len();
        for i in 0..n {
            let last = i + 1 == n || wrs[i + 1].wr_id != wrs[i].wr_id;
            if last {
                wrs[i].wr_id |= SIGNALLED;
            }
        }
    }

    /// Records the first `posted` of `wrs` (marked by [`Ledger::mark`]) as
    /// posted. A run cut short by a refused post is a group without a
    /// signalled request.
    pub(crate) fn posted(&mut self, wrs: &[WorkRequest], posted: usize) {
        let mut start = 0;
        for (i, w) in wrs[..posted].iter().enumerate() {
            let cut = i + 1 == posted && !w.signalled();
            if w.signalled() || cut {
                self.groups.push_back(Group {
                    wr_id: w.wr_id & !SIGNALLED,
                    requests: (i + 1 - start) as u32,
                    signalled: w.signalled(),
                    marker: false,
                    seen: 0,
                    bytes: wrs[start..=i].iter().map(|w| u64::from(w.len)).sum(),
                });
                start = i + 1;
            }
        }
    }

    /// The transfer (`wr_id` without [`SIGNALLED`]) of the cut group the
    /// last [`Ledger::posted`] left, if it left one: the marker to post after
    /// it carries that `wr_id` with [`SIGNALLED`].
    pub(crate) fn cut(&self) -> Option<u64> {
        let back = self.groups.back()?;
        (!back.signalled).then_some(back.wr_id)
    }

    /// The marker [`Ledger::cut`] asked for was posted: the group is retired
    /// by the marker's completion, with the marker's entry.
    pub(crate) fn close_cut(&mut self) {
        if let Some(back) = self.groups.back_mut().filter(|g| !g.signalled) {
            back.signalled = true;
            back.marker = true;
        }
    }

    /// Accounts for one reaped completion of this link, `success` or not.
    /// `None` when it matches no posted group (a completion the ledger did
    /// not expect: the caller logs it).
    pub(crate) fn complete(&mut self, wr_id: u64, success: bool) -> Option<Retired> {
        let front = self.groups.front_mut()?;
        let id = wr_id & !SIGNALLED;
        if front.wr_id != id {
            return None;
        }
        // Whether this completion retires the front group: its signalled
        // request's, or the last flush of a group that has none.
        let retires = if wr_id & SIGNALLED != 0 {
            if !front.signalled {
                return None;
            }
            true
        } else {
            // An unsignalled request completes only in error.
            if success {
                return None;
            }
            front.seen += 1;
            !front.signalled && front.seen == front.requests
        };
        let (requests, entries, bytes) = match retires {
            true => {
                let g = self.groups.pop_front()?;
                (g.requests, g.requests + u32::from(g.marker), g.bytes)
            }
            false => (0, 0, 0),
        };
        Some(Retired {
            wr_id: id,
            requests,
            entries,
            bytes,
        })
    }

    /// Groups posted and not yet retired.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.groups.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(wr_id: u64) -> WorkRequest {
        WorkRequest {
            wr_id,
            read: false,
            local: 0,
            len: 8,
            lkey: 0,
            remote: 0,
            rkey: 0,
            inline: false,
        }
    }

    fn retired(wr_id: u64, requests: u32) -> Option<Retired> {
        Some(Retired {
            wr_id,
            requests,
            entries: requests,
            bytes: 8 * u64::from(requests),
        })
    }

    fn marked(ids: &[u64]) -> Vec<WorkRequest> {
        let mut wrs: Vec<WorkRequest> = ids.iter().map(|&i| wr(i)).collect();
        Ledger::mark(&mut wrs);
        wrs
    }

    #[test]
    fn only_the_last_request_of_each_run_and_of_the_doorbell_is_signalled() {
        let wrs = marked(&[1, 1, 1, 2, 2, 3, 1]);
        let signalled: Vec<bool> = wrs.iter().map(|w| w.signalled()).collect();
        assert_eq!(
            signalled,
            [false, false, true, false, true, true, true],
            "{wrs:?}"
        );
        let one = marked(&[7]);
        assert!(one[0].signalled());
    }

    #[test]
    fn a_group_is_retired_whole_by_its_signalled_completion_and_not_before() {
        let wrs = marked(&[1, 1, 1, 2, 2]);
        let mut l = Ledger::default();
        l.posted(&wrs, wrs.len());
        assert_eq!(l.len(), 2);
        // An unsignalled request never completes successfully: a success
        // without the mark is not ours.
        assert_eq!(l.complete(1, true), None);
        assert_eq!(l.complete(1 | SIGNALLED, true), retired(1, 3));
        // Out of order (the second group's signal while the first is
        // pending) would be a device bug: never taken as a retirement.
        let mut l2 = Ledger::default();
        l2.posted(&wrs, wrs.len());
        assert_eq!(l2.complete(2 | SIGNALLED, true), None);
        assert_eq!(l2.len(), 2);
        assert_eq!(l.complete(2 | SIGNALLED, true), retired(2, 2));
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn errors_of_unsignalled_requests_retire_nothing_until_the_signalled_one_is_reaped() {
        let wrs = marked(&[4, 4, 4, 4]);
        let mut l = Ledger::default();
        l.posted(&wrs, 4);
        // The second request fails, the third is flushed: each is reported,
        // neither retires the group, whose buffer the NIC may still read
        // until the last request's flush is reaped.
        for _ in 0..2 {
            assert_eq!(l.complete(4, false), retired(4, 0));
            assert_eq!(l.len(), 1);
        }
        assert_eq!(l.complete(4 | SIGNALLED, false), retired(4, 4));
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn a_run_cut_short_by_a_refused_post_is_retired_by_its_flushes() {
        let wrs = marked(&[5, 5, 5, 6]);
        let mut l = Ledger::default();
        // The device took two requests of transfer 5, neither signalled.
        l.posted(&wrs, 2);
        assert_eq!(l.len(), 1);
        assert_eq!(l.complete(5, false), retired(5, 0));
        assert_eq!(l.complete(5, false), retired(5, 2));
        assert_eq!(l.len(), 0);
        // A post that ends on a signalled request leaves no cut group.
        let mut l = Ledger::default();
        l.posted(&wrs, 3);
        assert_eq!(l.len(), 1);
        assert_eq!(l.complete(5 | SIGNALLED, false), retired(5, 3));
        // And nothing posted, nothing recorded.
        let mut l = Ledger::default();
        l.posted(&wrs, 0);
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn a_cut_run_part_of_which_completed_silently_is_retired_by_its_marker() {
        let wrs = marked(&[5, 5, 5, 6]);
        let mut l = Ledger::default();
        l.posted(&wrs, 2);
        assert_eq!(l.cut(), Some(5));
        l.close_cut();
        assert_eq!(l.cut(), None);
        // The first request completed (silently) before the QP went to
        // error; only the second is flushed, then the marker.
        assert_eq!(l.complete(5, false), retired(5, 0));
        assert_eq!(l.len(), 1);
        assert_eq!(
            l.complete(5 | SIGNALLED, false),
            Some(Retired {
                wr_id: 5,
                requests: 2,
                entries: 3,
                bytes: 16,
            })
        );
        assert_eq!(l.len(), 0);
        // A post that ends on a signalled request needs no marker.
        let mut l = Ledger::default();
        l.posted(&wrs, 3);
        assert_eq!(l.cut(), None);
    }
}
