//! One RC queue pair towards a peer, as the [`Reaper`](super::reaper::Reaper)
//! posts on it: its state, its send queue's accounting and what it queued
//! for the next doorbell.
//!
//! States:
//! * `Ready` — requests are posted.
//! * `Failed` — a completion failed, or a flush came while the link was
//!   `Ready` (something else moved the QP: the device's asynchronous fatal
//!   error); the QP is in the error state and every posted request will
//!   come back flushed. Queued requests are failed without being posted.
//! * `Fenced` — moved to the error state by a fence or an abort; as above.
//!
//! A link that is not `Ready` is never used again: the peer builds a new one
//! lazily, and the old QP is destroyed when its last slot is reaped.

use std::cell::{Cell, RefCell};
use std::collections::{HashSet, VecDeque};

use super::ledger::Ledger;
use super::verbs::{Qp, WorkRequest};
use crate::error::TransferError;

/// Where a link stands (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkState {
    /// Invariant: the QP is in RTS and posts go out.
    Ready,
    /// Invariant: the QP is in the error state because a completion failed
    /// or flushed unasked, or the control connection ended.
    Failed,
    /// Invariant: the QP was moved to the error state by a fence or abort.
    Fenced,
}

/// One RC queue pair towards a peer.
pub(crate) struct Link {
    pub(crate) qp: Qp,
    pub(super) state: Cell<LinkState>,
    /// Posted and not yet known done (send queue entries in use).
    pub(super) outstanding: Cell<u32>,
    /// Its posted groups of requests, oldest first.
    pub(super) ledger: RefCell<Ledger>,
    /// Queued for the next doorbell.
    pub(super) queued: RefCell<VecDeque<WorkRequest>>,
    pub(super) in_dirty: Cell<bool>,
    pub(super) depth: u32,
    /// Batches fenced on this link: their flushed requests report `Fenced`.
    pub(super) fenced: RefCell<HashSet<u64>>,
    /// Identity of the control connection the link was set up on.
    pub(crate) conn: usize,
    /// The target's queue pair number.
    pub(crate) remote_qpn: u32,
}

impl Link {
    pub(crate) fn new(qp: Qp, depth: u32, conn: usize, remote_qpn: u32) -> Link {
        Link {
            qp,
            state: Cell::new(LinkState::Ready),
            outstanding: Cell::new(0),
            ledger: RefCell::default(),
            queued: RefCell::default(),
            in_dirty: Cell::new(false),
            depth,
            fenced: RefCell::default(),
            conn,
            remote_qpn,
        }
    }

    pub(crate) fn state(&self) -> LinkState {
        self.state.get()
    }

    /// Moves the QP to the error state: posted requests flush, queued ones
    /// fail at the next doorbell without being posted.
    pub(crate) fn fence(&self, batch: Option<u64>) {
        if let Some(b) = batch {
            self.fenced.borrow_mut().insert(b);
        }
        if self.state.get() == LinkState::Ready {
            self.state.set(LinkState::Fenced);
        }
        if let Err(e) = self.qp.set_error() {
            tracing::warn!(error = %e, "moving a queue pair to the error state failed");
        }
    }

    /// The peer is gone (its control connection ended): to the error state.
    pub(crate) fn lost(&self) {
        if self.state.get() == LinkState::Ready {
            self.state.set(LinkState::Failed);
        }
        if let Err(e) = self.qp.set_error() {
            tracing::warn!(error = %e, "moving a queue pair to the error state failed");
        }
    }

    /// The error of a request of `batch` flushed by the QP's reset, or
    /// failed at the next doorbell without being posted (`posted: false`).
    pub(super) fn flushed_error(&self, batch: u64, posted: bool) -> TransferError {
        if self.fenced.borrow().contains(&batch) {
            // Posted: packets it sent may still land until the target
            // confirms; never posted: nothing left.
            if posted {
                TransferError::Flushed
            } else {
                TransferError::Fenced
            }
        } else {
            let why = match self.state.get() {
                LinkState::Fenced => "queue pair reset by a fence or abort",
                _ => "queue pair failed (peer lost, or another request's error flushed this one)",
            };
            match posted {
                true => TransferError::ConnectionLost(why.into()),
                // Never handed to the NIC: nothing of it was sent.
                false => TransferError::NotSent(why.into()),
            }
        }
    }
}
