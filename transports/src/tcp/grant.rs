//! An initiator connection's proofs of segment tokens (`Auth`), and the
//! grants they earn it: which grant receipt each proof names, and which
//! writes the connection may carry because of them (PROTOCOL.md §5.1).

use crate::control::auth::Token;
use crate::control::frame::send_frame;
use crate::control::wire::{
    AuthAck, AuthRequest, GrantReceipt, Header, Opcode, SegmentRef, Status,
};
use crate::error::TransferError;
use crate::tcp::conn::{Conn, SegmentGrant, SendGuard, REGRANTS};
use crate::tcp::responses::{slot, wait};

impl Conn {
    /// Proves tokens for segments (by id, or by name to open them); returns
    /// the target's verdicts.
    ///
    /// Each proof asks for the newest grant this connection was given a
    /// receipt for. A segment revoked since is answered with a receipt for
    /// its newer grant, and proven again naming it (at most [`REGRANTS`]
    /// times): the target grants a proof only an epoch it already told the
    /// initiator of, so that a proof sent before a revoke never regrants
    /// the writes behind it (PROTOCOL.md §5.1).
    pub(crate) async fn auth(
        &self,
        tokens: &[(SegmentRef, Token)],
    ) -> Result<AuthAck, TransferError> {
        let mut asked: Vec<GrantReceipt> = tokens
            .iter()
            .map(|(seg, _)| match seg {
                SegmentRef::Id(id) => self.grants.borrow().get(id).copied(),
                _ => None,
            })
            .map(|g| g.unwrap_or(GrantReceipt::NONE))
            .collect();
        let proofs: Vec<_> = tokens
            .iter()
            .zip(&asked)
            .map(|((seg, t), g)| (seg.clone(), *t, *g))
            .collect();
        let mut ack = self.auth_once(&proofs).await?;
        if ack.results.len() != tokens.len() {
            // (The caller refuses a wrong count.)
            return Ok(ack);
        }
        for _ in 0..REGRANTS {
            let behind: Vec<usize> = (0..tokens.len())
                .filter(|&i| match &ack.results[i] {
                    (Status::Ok, Some(d)) => d.grant.epoch > asked[i].epoch,
                    _ => false,
                })
                .collect();
            if behind.is_empty() {
                break;
            }
            let again: Vec<_> = behind
                .iter()
                .map(|&i| {
                    let d = ack.results[i].1.as_ref().expect("an opened proof");
                    (SegmentRef::Id(d.id), tokens[i].1, d.grant)
                })
                .collect();
            let more = self.auth_once(&again).await?;
            if more.results.len() != again.len() {
                return Err(TransferError::BadFrame(
                    "an AuthAck with the wrong count".into(),
                ));
            }
            for ((&i, (_, _, g)), answer) in behind.iter().zip(&again).zip(more.results) {
                match answer.0 {
                    Status::Ok => {
                        asked[i] = *g;
                        ack.results[i] = answer;
                    }
                    // Refused the second time (deregistered meanwhile):
                    // the first answer stands, with the grant it gave.
                    _ => asked[i].epoch = u64::MAX,
                }
            }
        }
        self.keep_grants(&ack);
        Ok(ack)
    }

    /// Keeps the grant receipts of `ack`'s opened segments, for this
    /// connection's next proofs of them.
    fn keep_grants(&self, ack: &AuthAck) {
        let mut grants = self.grants.borrow_mut();
        for d in ack.results.iter().filter_map(|(_, d)| d.as_ref()) {
            let g = grants.entry(d.id).or_insert(GrantReceipt::NONE);
            if d.grant.epoch > g.epoch {
                *g = d.grant;
            }
        }
    }

    /// One `Auth` of `proofs` (segment, token, the grant asked for), and
    /// its answer.
    async fn auth_once(
        &self,
        proofs: &[(SegmentRef, Token, GrantReceipt)],
    ) -> Result<AuthAck, TransferError> {
        let proven = proofs
            .iter()
            .map(|(seg, t, g)| {
                let proof = t.prove(&self.hello.nonce, &self.nonce, self.session, seg);
                (seg.clone(), proof, *g)
            })
            .collect();
        let payload = AuthRequest {
            join: self.join,
            proofs: proven,
        }
        .encode()?;
        let result = slot();
        // Queued under the send lock, right before the frame: answers come
        // in the order frames went, and a caller that gives up while it
        // waits for the lock leaves no slot behind (the next auth's answer
        // would fill it).
        let mut g = self.send_guard().await;
        {
            let mut st = self.state.borrow_mut();
            if st.dead.is_some() {
                drop(st);
                g.complete = true;
                return Err(self.lost());
            }
            st.auths.push_back(result.clone());
        }
        self.keep_granted(proofs);
        let r = send_frame(
            &self.stream,
            &Header {
                length: payload.len() as u64,
                ..Header::new(Opcode::Auth)
            },
            &payload,
        )
        .await;
        g.complete = r.is_ok();
        drop(g);
        wait(&result).await
    }

    /// Counts the grants `proofs` name as this connection's, as their
    /// `Auth` goes out (under the send lock): the target applies them to
    /// every frame behind it, before this side reads the answer. A proof
    /// the target refuses (or a receipt it no longer honours) granted less,
    /// which only makes [`refuses_write`](Self::refuses_write) refuse more.
    /// Proofs by name, address or first name no receipt: epoch 0.
    fn keep_granted(&self, proofs: &[(SegmentRef, Token, GrantReceipt)]) {
        let mut granted = self.granted.borrow_mut();
        for (seg, _, asked) in proofs {
            let SegmentRef::Id(id) = seg else {
                continue;
            };
            let g = granted.entry(*id).or_insert(GrantReceipt::NONE);
            if asked.epoch > g.epoch {
                *g = *asked;
                self.granted_max
                    .set(self.granted_max.get().max(asked.epoch));
            }
        }
    }

    /// The grant this connection holds for segment `id`.
    pub(crate) fn granted(&self, id: u64) -> GrantReceipt {
        match self.granted_max.get() {
            0 => GrantReceipt::NONE,
            _ => self
                .granted
                .borrow()
                .get(&id)
                .copied()
                .unwrap_or(GrantReceipt::NONE),
        }
    }

    /// Whether this connection holds a grant of segment `id` newer than
    /// epoch `ceiling`: one a revoke made after a handle opened under
    /// `ceiling`, whose writes must then not go out here.
    pub(crate) fn granted_above(&self, id: u64, ceiling: u64) -> bool {
        self.granted_max.get() > ceiling && self.granted(id).epoch > ceiling
    }

    /// True if a write to `to` must not go out on this connection, asked
    /// under its send lock `g` (released cleanly then): the connection
    /// holds a newer grant of the segment than the write's handle, so the
    /// write may have been made before the revoke that grant follows, and
    /// would land where the revoke promised nothing earlier does. Under
    /// the lock, since a newer proof is counted as granted when its `Auth`
    /// goes out ([`auth_once`](Self::auth_once)): a write checked before
    /// that goes out ahead of it, under the older grant.
    pub(crate) fn refuses_write(&self, g: &mut SendGuard<'_>, to: SegmentGrant) -> bool {
        if !self.granted_above(to.id, to.ceiling) {
            return false;
        }
        g.complete = true;
        true
    }

    /// Proves tokens naming the given grant receipts, and no newer one the
    /// answer offers: a reconnect proves the grants its segments were
    /// opened under, so that it carries no write made before a revoke
    /// under the grant the revoke made (PROTOCOL.md §5.1).
    pub(crate) async fn auth_as_opened(
        &self,
        proofs: &[(SegmentRef, Token, GrantReceipt)],
    ) -> Result<AuthAck, TransferError> {
        let ack = self.auth_once(proofs).await?;
        self.keep_grants(&ack);
        Ok(ack)
    }
}
