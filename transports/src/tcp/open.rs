//! Opening a peer's segments: a token proven on the control connection
//! (within the connect timeout), then on every data connection of the peer
//! (until the connect timeout passes with no answer to any of its
//! requests).

use std::pin::pin;
use std::rc::Rc;

use quiesce_runtime::time::timeout;

use crate::control::auth::Token;
use crate::control::wire::{AuthAck, Descriptor, SegmentRef, Status};
use crate::error::TransferError;
use crate::tcp::conn::Conn;
use crate::tcp::peer::{Opened, Peer};
use crate::tcp::segment::{Proven, RemoteSegment};

impl Peer {
    /// Opens the segment named `name` by proving `token` (on the control
    /// connection, then on every data connection, which are connected now
    /// if they are not). The target refuses a wrong token and an unknown
    /// name alike ([`TransferError::OpenRefused`]).
    pub async fn open(&self, name: &str, token: Token) -> Result<RemoteSegment, TransferError> {
        let seg = SegmentRef::Name(name.to_string());
        self.open_ref(seg, token, |d| d.name == name, || name.to_string())
            .await
    }

    /// Opens the segment that holds the target's virtual address `addr`
    /// (Mooncake-style addressing: callers name remote memory by the peer's
    /// addresses), proving `token` for it. Its descriptor's `base` maps
    /// addresses to offsets. Refused like [`open`](Self::open) when no
    /// segment holds the address or the token is wrong.
    pub async fn open_at(&self, addr: u64, token: Token) -> Result<RemoteSegment, TransferError> {
        let holds = |d: &Descriptor| addr.checked_sub(d.base).is_some_and(|o| o < d.len);
        self.open_ref(SegmentRef::Address(addr), token, holds, || {
            format!("the segment at {addr:#x}")
        })
        .await
    }

    /// Opens the segment the target registered first among those live now
    /// that `token` opens (Mooncake's `get_first_buffer_address`). Refused
    /// like [`open`](Self::open) when `token` opens none.
    pub async fn open_first(&self, token: Token) -> Result<RemoteSegment, TransferError> {
        self.open_ref(
            SegmentRef::First,
            token,
            |_| true,
            || "the first registered segment".to_string(),
        )
        .await
    }

    async fn open_ref(
        &self,
        seg: SegmentRef,
        token: Token,
        is_it: impl Fn(&Descriptor) -> bool,
        what: impl Fn() -> String,
    ) -> Result<RemoteSegment, TransferError> {
        let control = self.control().await?;
        let ack = self
            .auth_within(&control, &[(seg, token)], Bound::Deadline)
            .await?;
        // A target that broke the protocol loses the connection, as on a
        // data connection or a reconnect's proof.
        let broke = |why: &str| {
            control.kill(why);
            Err(TransferError::BadFrame(why.into()))
        };
        let desc = match ack.results.as_slice() {
            [(Status::Ok, Some(d))] if is_it(d) => d.clone(),
            [(Status::Ok, _)] => {
                return broke("an AuthAck without the opened segment's descriptor")
            }
            [_] => return Err(TransferError::OpenRefused(what())),
            _ => return broke("an AuthAck with the wrong count"),
        };
        let desc = {
            let mut opened = self.inner.opened.borrow_mut();
            // The segment opened before under this id, if it is this one
            // (its handles stay good; this open's are new); else that one
            // is gone.
            let desc = match opened.get(&desc.id) {
                Some(o) if o.desc.same_segment(&desc) => Rc::new(o.desc.again(desc)),
                before => {
                    if let Some(o) = before {
                        o.desc.forget();
                    }
                    Rc::new(Proven::new(desc))
                }
            };
            let proven = Opened {
                token,
                desc: desc.clone(),
            };
            opened.insert(desc.id, proven);
            desc
        };
        // Before the data connections: one that reconnects below proves
        // the grant this open was given.
        desc.opened_with(control.granted(desc.id));
        let n = self.inner.conns.borrow().len();
        for i in 1..n {
            match self.live(i) {
                // Its auth may wait behind the connection's bulk (the send
                // lock, answers ahead of it): bounded by the target's
                // silence, not by a deadline (a long transfer is no dead
                // target).
                Some(c) => {
                    let proof = [(SegmentRef::Id(desc.id), token)];
                    let ack = self.auth_within(&c, &proof, Bound::Silence).await?;
                    check_auth(&[desc.id], &ack.results)?;
                }
                // A new connection proves every opened token, this one too.
                None => {
                    self.conn(i).await?;
                }
            }
        }
        // A revoke while the data connections proved may have given one of
        // them a newer grant than the control connection's: the handle
        // writes under the newest this open was given (its writes are made
        // after the open, so after that revoke).
        for i in 1..n {
            if let Some(c) = self.live(i) {
                desc.opened_with(c.granted(desc.id));
            }
        }
        desc.seal();
        Ok(RemoteSegment {
            peer: self.clone(),
            desc,
        })
    }

    /// Connection `c`'s answer to an `Auth` of `tokens`, within the connect
    /// timeout as `bound` says. A target that does not answer in time (a
    /// frozen process, whose kernel still acks, or one that answers
    /// nothing) gets the connection killed, and the open fails as
    /// `ConnectionLost` instead of waiting for good.
    async fn auth_within(
        &self,
        c: &Conn,
        tokens: &[(SegmentRef, Token)],
        bound: Bound,
    ) -> Result<AuthAck, TransferError> {
        let limit = self.inner.params.connect_timeout;
        let mut auth = pin!(c.auth(tokens));
        loop {
            let heard = c.answers();
            match timeout(limit, auth.as_mut()).await {
                Ok(r) => return r,
                Err(_) if bound == Bound::Silence && c.answers() != heard => continue,
                Err(_) => {
                    c.kill("no auth ack within the connect timeout");
                    return Err(TransferError::ConnectionLost(format!(
                        "opening a segment of {}: no auth ack within {limit:?}",
                        self.inner.addr
                    )));
                }
            }
        }
    }
}

/// How long an open waits for an `Auth`'s answer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bound {
    /// The connect timeout: the control connection carries no bulk, so
    /// nothing but the target's silence delays its answer.
    Deadline,
    /// The connect timeout without an answer to any of the connection's
    /// requests: a data connection's `Auth` waits behind its bulk (the
    /// send lock, answers ahead of it) as long as the target answers that.
    /// Neither this initiator's own sends nor frames for no request count:
    /// a frozen target's kernel takes the one, a hostile target sends the
    /// other. (A target that answers the other requests and never the
    /// `Auth` holds it as long as they come.)
    Silence,
}

fn check_auth(ids: &[u64], results: &[(Status, Option<Descriptor>)]) -> Result<(), TransferError> {
    if results.len() != ids.len() {
        return Err(TransferError::BadFrame(
            "an AuthAck with the wrong count".into(),
        ));
    }
    for (id, (st, _)) in ids.iter().zip(results) {
        if *st != Status::Ok {
            return Err(TransferError::Forbidden(*id));
        }
    }
    Ok(())
}
