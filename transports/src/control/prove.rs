//! `Auth` on a served connection: each proof checked against the segments
//! it can name — by id, by name, by an address inside it (segments may
//! overlap: every one holding the address is tried), or the first the
//! proof opens — for no more work than a budget per frame, and a refusal
//! that looks the same, after the same work, whatever it refused.

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::control::server::{peer_name, reject, Closed, ServedConn, SessionEntry};
use crate::control::wire::{
    AuthAck, AuthRequest, Descriptor, GrantReceipt, Header, Opcode, SegmentRef, Status,
    MAX_HANDSHAKE_PAYLOAD,
};
use crate::segment::Segment;

/// HMACs of refused `First` proofs, with `segments` served, that a
/// connection may spend at once before it is closed: four passes over
/// distinct tokens, or 32 refusals of a token they share (two HMACs each).
fn refused_first_budget(segments: usize) -> usize {
    64 + 4 * segments
}

/// The target's budget of refused proofs over all its connections, in
/// connections' `First` budgets: past it a `First` proof is refused
/// unchecked until it refills, so that a peer reconnecting after every
/// close gets no fresh pass over the segments each time. (While one peer
/// keeps it spent, honest `First` opens are refused too; other proofs are
/// checked as ever, and no connection is closed for it.)
pub(crate) const TARGET_REFUSED_BUDGETS: usize = 16;

/// How long a budget takes to refill from empty: an initiator polling for
/// the target's first registration a few times a second keeps its
/// connection; a peer flooding refusals is closed within the budget.
const REFUSED_REFILL: Duration = Duration::from_secs(10);

/// HMACs spent on refused proofs, less what [`REFUSED_REFILL`] gave back
/// since they were charged: a budget refills at `budget` HMACs per refill
/// time, counted exactly (in HMAC-milliseconds), however often it is
/// charged.
#[derive(Default)]
pub(crate) struct RefusedWork {
    /// Spent, in HMACs × milliseconds of refill.
    owed: u128,
    /// When `owed` was last brought up to date.
    at: Option<Instant>,
}

impl RefusedWork {
    /// What is owed at `now`, after the refill since.
    fn owed_at(&self, budget: usize, now: Instant) -> u128 {
        let back = self.at.map_or(0, |at| {
            budget as u128 * now.saturating_duration_since(at).as_millis()
        });
        self.owed.saturating_sub(back)
    }

    fn limit(budget: usize) -> u128 {
        budget as u128 * REFUSED_REFILL.as_millis()
    }

    /// Whether nothing is left of `budget` at `now`.
    fn exhausted(&self, budget: usize, now: Instant) -> bool {
        self.owed_at(budget, now) >= Self::limit(budget)
    }

    /// Charges `work` HMACs at `now`: whether that went past `budget`.
    fn charge(&mut self, work: usize, budget: usize, now: Instant) -> bool {
        let refill_ms = REFUSED_REFILL.as_millis();
        self.owed = self
            .owed_at(budget, now)
            .saturating_add(work as u128 * refill_ms);
        // (Brought up to date to the millisecond the refill counted.)
        self.at = Some(match self.at {
            Some(at) => {
                at + Duration::from_millis(now.saturating_duration_since(at).as_millis() as u64)
            }
            None => now,
        });
        self.owed > Self::limit(budget)
    }
}

impl ServedConn<'_> {
    /// `Auth`: each proof checked against the segment it names; answers
    /// `AuthAck` with a status (and, opened, a descriptor) per proof.
    pub(crate) async fn auth(&mut self, h: &Header) -> Result<(), Closed> {
        let req = self
            .decoded(h, MAX_HANDSHAKE_PAYLOAD, AuthRequest::decode)
            .await?;
        // A `First` proof is checked against every segment served: one per
        // request (all `open_first` sends), or one frame from a peer that
        // proved nothing could cost thousands of HMACs per segment.
        let firsts = req
            .proofs
            .iter()
            .filter(|(r, ..)| matches!(r, SegmentRef::First));
        if firsts.count() > 1 {
            let why = "more than one First proof in one Auth".into();
            return Err(reject(self.s, h, Status::BadFrame, why).await);
        }
        // Joining a live session takes its key: checked on the first Auth,
        // before any proof counts.
        if matches!(self.entry, SessionEntry::Join) {
            let ok = self
                .engine
                .session_key(self.session)
                .is_some_and(|k| k.verify(&req.join, &self.nonce, &self.peer_nonce, self.session));
            if !ok {
                return Err(reject(
                    self.s,
                    h,
                    Status::Forbidden,
                    "no proof of the session's key".into(),
                )
                .await);
            }
        }
        // The HMACs one Auth may cost: two per proof and two per grant
        // receipt (the one it names, the one its answer carries), and one
        // First's pass over every segment. Proofs by address try every
        // segment holding the address, so a frame of many into overlapping
        // segments could cost more: past the budget it is a bad frame.
        let segments = self.engine.segments.borrow().len();
        let budget = 4 * req.proofs.len() + segments + 1;
        let now = Instant::now();
        let target_budget = TARGET_REFUSED_BUDGETS * refused_first_budget(segments);
        // The target's budget spent (a flood of refusals, perhaps over many
        // connections): a `First` proof, one HMAC per segment, is refused
        // unchecked until it refills.
        let check_firsts = !self
            .engine
            .refused_proofs
            .borrow()
            .exhausted(target_budget, now);
        let work = Cell::new(0usize);
        let refused_work = Cell::new(0usize);
        let refused_first_work = Cell::new(0usize);
        let results = req
            .proofs
            .iter()
            .map(|(seg_ref, proof, grant)| {
                if work.get() > budget {
                    return (Status::BadFrame, None);
                }
                if !check_firsts && matches!(seg_ref, SegmentRef::First) {
                    return (Status::Forbidden, None);
                }
                let before = work.get();
                let answer = self.answer(seg_ref, proof, grant, &work);
                if answer.0 != Status::Ok {
                    let spent = work.get() - before;
                    refused_work.set(refused_work.get() + spent);
                    if matches!(seg_ref, SegmentRef::First) {
                        refused_first_work.set(refused_first_work.get() + spent);
                    }
                }
                answer
            })
            .collect::<Vec<_>>();
        let checks = &self.engine.counters.proof_checks;
        checks.set(checks.get() + work.get() as u64);
        if work.get() > budget {
            let why = format!("an Auth whose proofs cost over {budget} HMACs");
            return Err(reject(self.s, h, Status::BadFrame, why).await);
        }
        // Refusals cost the target's budget, and refused `First` proofs the
        // connection's: past that, the connection is closed.
        if refused_work.get() > 0 {
            self.engine
                .refused_proofs
                .borrow_mut()
                .charge(refused_work.get(), target_budget, now);
        }
        if refused_first_work.get() > 0 {
            let firsts = refused_first_budget(segments);
            if self
                .refused_firsts
                .charge(refused_first_work.get(), firsts, now)
            {
                let why = format!("refused First proofs cost over {firsts} HMACs");
                return Err(reject(self.s, h, Status::Forbidden, why).await);
            }
        }
        let refused = results.iter().filter(|(st, _)| *st != Status::Ok).count();
        if refused > 0 {
            let limit = &self.engine.peer_logs.refused_proof;
            if let Some(suppressed) = limit.admit() {
                tracing::warn!(
                    peer = %peer_name(self.s.peer_addr().ok()),
                    refused,
                    suppressed,
                    "{}",
                    limit.what()
                );
            }
        }
        let payload = match (AuthAck { results }).encode() {
            Ok(p) => p,
            // (Too many descriptors, or too long, for a frame: no initiator
            // of ours asks for so many at once.)
            Err(e) => return Err(reject(self.s, h, Status::BadFrame, e.to_string()).await),
        };
        let head = Header {
            op: Opcode::AuthAck,
            length: payload.len() as u64,
            ..*h
        };
        self.send(&head, &payload).await?;
        Ok(())
    }

    /// One proof's answer: its segment opened, or refused. `work` counts
    /// the HMACs it took.
    ///
    /// A proof opened is granted the epoch its receipt names, if the target
    /// issued that receipt (else the first, epoch 0), and never less than
    /// the connection held: not the epoch current when the target reads
    /// it. The proof — and every write behind it — may have been sent
    /// before a revoke the target made before reading it; a receipt of the
    /// revoke's epoch was sent after that revoke, so a proof naming it was
    /// too (PROTOCOL.md §5.1).
    fn answer(
        &mut self,
        seg_ref: &SegmentRef,
        proof: &[u8; 32],
        grant: &GrantReceipt,
        work: &Cell<usize>,
    ) -> (Status, Option<Descriptor>) {
        // Segments may share a token (a Mooncake-style node derives
        // one for all of them): each is checked once per proof.
        let checked = RefCell::new(HashMap::<[u8; 16], bool>::new());
        let verify = |t: &crate::control::auth::Token| {
            if let Some(&known) = checked.borrow().get(&t.0) {
                return known;
            }
            work.set(work.get() + 1);
            let ok = t.verify(proof, &self.nonce, &self.peer_nonce, self.session, seg_ref);
            checked.borrow_mut().insert(t.0, ok);
            ok
        };
        let seg = match seg_ref {
            SegmentRef::Id(id) => self.engine.segment(*id),
            SegmentRef::Name(n) => self.engine.segment_named(n),
            // Segments may overlap. Of those that hold the address
            // and that the proof opens, the one reaching furthest:
            // a transfer from the address that fits any of them
            // fits it (ties: the first registered).
            SegmentRef::Address(a) => {
                let reach = |s: &Segment| (Reverse(s.base().saturating_add(s.len())), s.id());
                match self.engine.proven_segment(Some(*a), verify, reach) {
                    (None, tried) if tried > 0 => return (Status::Forbidden, None),
                    (seg, _) => seg,
                }
            }
            // Ids only grow: the first registered.
            SegmentRef::First => self.engine.proven_segment(None, verify, Segment::id).0,
        };
        match seg {
            Some(seg) if verify(&seg.token()) => {
                let issued = grant.epoch <= seg.inner.grants.current()
                    && (grant.epoch == 0 || {
                        work.set(work.get() + 1);
                        self.engine.grant_key.issued(seg.id(), grant)
                    });
                let named = if issued { grant.epoch } else { 0 };
                let held = self.authorised.get(&seg.id()).copied().unwrap_or(0);
                self.authorised.insert(seg.id(), held.max(named));
                // The answer's receipt: the one named, if it is the current
                // epoch's; else an HMAC more once the segment was revoked.
                let current = seg.inner.grants.current();
                let answer = if issued && grant.epoch == current {
                    *grant
                } else {
                    if current > 0 {
                        work.set(work.get() + 1);
                    }
                    self.engine.grant_key.receipt(seg.id(), current)
                };
                self.census.authenticated();
                (Status::Ok, Some(self.engine.descriptor(&seg, answer)))
            }
            Some(_) => (Status::Forbidden, None),
            // The same answer, after the same work, as a wrong
            // proof: a refusal does not say whether it exists.
            None => {
                let _ = verify(&unknown_segment_token());
                (Status::Forbidden, None)
            }
        }
    }
}

/// The key proofs for unknown segment ids are checked against, so that a
/// refusal costs the same whether the segment exists or not.
fn unknown_segment_token() -> crate::control::auth::Token {
    thread_local! {
        static T: crate::control::auth::Token = crate::control::auth::Token::random();
    }
    T.with(|t| *t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A budget refills at its rate however often it is charged: one HMAC
    /// every 9 ms against a budget of 1,000 per 10 s (0.9 back per charge)
    /// stays far below it. Rounding each refill down to whole HMACs, and
    /// restarting the clock at every charge, gave nothing back at all at
    /// that rate, and the budget ran out after 1,000 charges.
    #[test]
    fn a_budget_charged_often_still_refills() {
        let mut w = RefusedWork::default();
        let t0 = Instant::now();
        for i in 0..1200u64 {
            let over = w.charge(1, 1000, t0 + Duration::from_millis(9 * i));
            assert!(!over, "over the budget at charge {i}");
        }
        assert!(!w.exhausted(1000, t0 + Duration::from_millis(9 * 1200)));
    }
}
