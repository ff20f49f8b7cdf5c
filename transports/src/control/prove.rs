//! `Auth` on a served connection: each proof checked against the segments
//! it can name — by id, by name, by an address inside it (segments may
//! overlap: every one holding the address is tried), or the first the
//! proof opens — for no more work than a budget per frame, and a refusal
//! that looks the same, after the same work, whatever it refused.

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::HashMap;
use std::time::Instant;

use crate::control::frame::send_frame;
use crate::control::server::{
    peer_name, refused_first_budget, reject, Closed, ServedConn, SessionEntry, REFUSED_FIRST_REFILL,
};
use crate::control::wire::{
    AuthAck, AuthRequest, Header, Opcode, SegmentRef, Status, MAX_HANDSHAKE_PAYLOAD,
};
use crate::segment::Segment;

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
            .filter(|(r, _)| matches!(r, SegmentRef::First));
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
        // The HMACs one Auth may cost: two per proof, and one First's pass
        // over every segment. Proofs by address try every segment holding
        // the address, so a frame of many into overlapping segments could
        // cost more: past the budget it is a bad frame.
        let budget = 2 * req.proofs.len() + self.engine.segments.borrow().len() + 1;
        let work = Cell::new(0usize);
        let results = req
            .proofs
            .iter()
            .map(|(seg_ref, proof)| {
                if work.get() > budget {
                    return (Status::BadFrame, None);
                }
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
                        let reach =
                            |s: &Segment| (Reverse(s.base().saturating_add(s.len())), s.id());
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
                        self.authorised.insert(seg.id(), seg.inner.grants.current());
                        self.census.authenticated();
                        (Status::Ok, Some(self.engine.descriptor(&seg)))
                    }
                    Some(_) => (Status::Forbidden, None),
                    // The same answer, after the same work, as a wrong
                    // proof: a refusal does not say whether it exists.
                    None => {
                        let _ = verify(&unknown_segment_token());
                        (Status::Forbidden, None)
                    }
                }
            })
            .collect::<Vec<_>>();
        let checks = &self.engine.counters.proof_checks;
        checks.set(checks.get() + work.get() as u64);
        if work.get() > budget {
            let why = format!("an Auth whose proofs cost over {budget} HMACs");
            return Err(reject(self.s, h, Status::BadFrame, why).await);
        }
        let refused = results.iter().filter(|(st, _)| *st != Status::Ok).count();
        let first_refused = req
            .proofs
            .iter()
            .zip(&results)
            .any(|((r, _), (st, _))| matches!(r, SegmentRef::First) && *st != Status::Ok);
        if first_refused {
            let budget = refused_first_budget(self.engine.segments.borrow().len());
            let now = Instant::now();
            if let Some(at) = self.first_at {
                let back = budget as u128 * now.duration_since(at).as_millis()
                    / REFUSED_FIRST_REFILL.as_millis();
                self.first_work = self.first_work.saturating_sub(back as usize);
            }
            self.first_at = Some(now);
            self.first_work += work.get();
            if self.first_work > budget {
                let why = format!("refused First proofs cost over {budget} HMACs");
                return Err(reject(self.s, h, Status::Forbidden, why).await);
            }
        }
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
            Err(e) => return Err(Closed::Protocol(e.to_string())),
        };
        send_frame(
            self.s,
            &Header {
                op: Opcode::AuthAck,
                length: payload.len() as u64,
                ..*h
            },
            &payload,
        )
        .await?;
        Ok(())
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
