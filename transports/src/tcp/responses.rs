//! The initiator connection's reader task: it matches the target's
//! responses to the requests waiting for them (each a one-shot [`Reply`]
//! slot), and when the connection ends it fails whatever is still pending —
//! only after its own receive (possibly into a read's destination) has been
//! reaped.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::task::{Poll, Waker};

use crate::control::read_ahead::ReadAhead;
use crate::control::wire::{
    AuthAck, Opcode, QpAccept, Status, MAX_HANDSHAKE_PAYLOAD, MAX_QP_PAYLOAD,
};
use crate::error::TransferError;
use crate::tcp::conn::Conn;
use crate::tcp::split::Erased;
use quiesce_runtime::timeline::{self, Step};
use quiesce_runtime::IoBuf;

/// A one-shot result slot with a waker.
pub(crate) struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
}

impl<T> Slot<T> {
    /// Empties the slot for another request.
    pub(super) fn clear(&mut self) {
        self.value = None;
        self.waker = None;
    }
}

pub(crate) type Reply<T> = Rc<RefCell<Slot<T>>>;

pub(crate) fn slot<T>() -> Reply<T> {
    Rc::new(RefCell::new(Slot {
        value: None,
        waker: None,
    }))
}

/// Answers a read with the target's refusal `res`, unless it counts bytes
/// (`FencedPartial`, `Revoked`, `Unreachable`): a read is refused whole —
/// fences and revokes do not cut reads, and no status carries a read's
/// data — so a target that says so broke the protocol, and the read fails
/// as a bad frame (the caller closes the connection).
fn refuse_read(
    result: &Reply<Result<u64, TransferError>>,
    res: Result<u64, TransferError>,
) -> Result<(), &'static str> {
    match res {
        Err(
            TransferError::FencedPartial { .. }
            | TransferError::Revoked { .. }
            | TransferError::Unreachable { .. },
        ) => {
            let why = "a read refused with a count of bytes";
            fill(result, Err(TransferError::BadFrame(why.into())));
            Err(why)
        }
        res => {
            fill(result, res);
            Ok(())
        }
    }
}

/// Answers a write of `len` bytes with the target's `res`, unless it
/// counts more than that (`Ok` means every byte landed; a partial answer
/// counts those that did): a target that says so broke the protocol, and
/// the write fails as a bad frame (the caller closes the connection).
fn answer_write(
    result: &Reply<Result<u64, TransferError>>,
    len: Option<u64>,
    res: Result<u64, TransferError>,
) -> Result<(), &'static str> {
    let why = match (&res, len) {
        (Ok(n), Some(len)) if *n != len => Some("a write answered Ok for another length"),
        (
            Err(
                TransferError::FencedPartial { landed }
                | TransferError::Revoked { landed }
                | TransferError::Unreachable { landed },
            ),
            Some(len),
        ) if *landed > len => Some("a write answered with more bytes landed than it carried"),
        _ => None,
    };
    match why {
        Some(why) => {
            fill(result, Err(TransferError::BadFrame(why.into())));
            Err(why)
        }
        None => {
            fill(result, res);
            Ok(())
        }
    }
}

pub(crate) fn fill<T>(s: &Reply<T>, v: T) {
    let w = {
        let mut s = s.borrow_mut();
        s.value = Some(v);
        s.waker.take()
    };
    if let Some(w) = w {
        w.wake();
    }
}

pub(crate) async fn wait<T>(s: &Reply<T>) -> T {
    std::future::poll_fn(|cx| {
        let mut s = s.borrow_mut();
        match s.value.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    })
    .await
}

pub(crate) enum Pending {
    /// A write of `len` bytes (its answer may count no more), or another
    /// request answered by a status (`None`: its count is not of bytes).
    Write {
        len: Option<u64>,
        result: Reply<Result<u64, TransferError>>,
    },
    Read {
        dst: Option<Erased>,
        result: Reply<Result<u64, TransferError>>,
    },
}

#[derive(Default)]
pub(super) struct State {
    pub(super) dead: Option<String>,
    pub(super) pending: super::own_ids::OwnIdMap<Pending>,
    /// Fence waiters; filled with the QPN the target reset (0: none).
    pub(super) fences: super::own_ids::OwnIdMap<Vec<Reply<Result<u64, TransferError>>>>,
    pub(super) auths: VecDeque<Reply<Result<AuthAck, TransferError>>>,
    pub(super) qp_accepts: VecDeque<Reply<Result<QpAccept, TransferError>>>,
}

impl Conn {
    /// Settles request `id` (to `segment`) with the target's verdict `st`,
    /// `applied` bytes, when the answer came another way than the socket (a
    /// mailbox); a read that succeeded gets its bytes through `copy` first.
    /// An id no longer pending (the connection died meanwhile) is ignored.
    pub(crate) fn settle(
        &self,
        id: u64,
        segment: u64,
        st: Status,
        applied: u64,
        copy: impl FnOnce(&mut Erased),
    ) {
        let p = self.state.borrow_mut().pending.remove(&id);
        let res = match TransferError::from_status(st, segment, applied) {
            None => Ok(applied),
            Some(e) => Err(e),
        };
        match p {
            Some(Pending::Write { len, result }) => {
                if let Err(why) = answer_write(&result, len, res) {
                    self.kill(why);
                }
            }
            Some(Pending::Read {
                dst: Some(mut dst),
                result,
            }) if res.is_ok() => {
                if applied != dst.len() as u64 {
                    fill(
                        &result,
                        Err(TransferError::BadFrame(
                            "read data of the wrong length".into(),
                        )),
                    );
                    self.kill("read data of the wrong length");
                    return;
                }
                copy(&mut dst);
                drop(dst);
                fill(&result, res);
            }
            Some(Pending::Read { result, .. }) => {
                if let Err(why) = refuse_read(&result, res) {
                    self.kill(why);
                }
            }
            None => {}
        }
    }
}

/// Matches responses to requests until the connection ends; then fails
/// whatever is still pending.
pub(super) async fn read_loop(conn: Rc<Conn>) {
    let why = match read_responses(&conn).await {
        Ok(()) => conn.death_reason("closed by the target"),
        Err(e) => conn.death_reason(&e.to_string()),
    };
    conn.kill(&why);
    let hooks = std::mem::take(&mut *conn.on_close.borrow_mut());
    hooks.into_iter().for_each(|f| f());
    // Everything pending, taken out; `dead` stays, so later requests name why.
    let st = {
        let mut st = conn.state.borrow_mut();
        let dead = st.dead.take();
        let taken = std::mem::take(&mut *st);
        st.dead = dead;
        taken
    };
    let err = TransferError::ConnectionLost(why);
    for (_, p) in st.pending {
        match p {
            Pending::Write { result, .. } => fill(&result, Err(err.clone())),
            Pending::Read { result, .. } => fill(&result, Err(err.clone())),
        }
    }
    st.fences
        .into_values()
        .flatten()
        .for_each(|r| fill(&r, Err(err.clone())));
    st.auths
        .into_iter()
        .for_each(|r| fill(&r, Err(err.clone())));
    st.qp_accepts
        .into_iter()
        .for_each(|r| fill(&r, Err(err.clone())));
}

async fn read_responses(conn: &Conn) -> Result<(), TransferError> {
    let s = &conn.stream;
    // Status frames sent back to back (a batch's) come in one receive, and
    // a small read's data with its header.
    let mut rx = ReadAhead::default();
    loop {
        let h = match rx.header(s).await? {
            None => return Ok(()),
            Some(h) => h?,
        };
        match h.op {
            Opcode::Status => {
                let st = h.status()?;
                let p = conn.state.borrow_mut().pending.remove(&h.task);
                if p.is_some() {
                    conn.answered();
                }
                let res = match TransferError::from_status(st, h.segment, h.length) {
                    None => Ok(h.length),
                    Some(e) => {
                        timeline::mark(Step::RefusalRead);
                        Err(e)
                    }
                };
                match p {
                    Some(Pending::Write { len, result }) => {
                        if let Err(why) = answer_write(&result, len, res) {
                            return Err(TransferError::BadFrame(why.into()));
                        }
                    }
                    // A read succeeds with ReadData; a status is always a
                    // refusal, of the whole read.
                    Some(Pending::Read { result, .. }) => {
                        let res =
                            res.and(Err(TransferError::BadFrame("status Ok for a read".into())));
                        if let Err(why) = refuse_read(&result, res) {
                            return Err(TransferError::BadFrame(why.into()));
                        }
                    }
                    None if st == Status::BadFrame => {
                        return Err(TransferError::BadFrame(
                            "target closed the connection".into(),
                        ))
                    }
                    None => {}
                }
            }
            Opcode::ReadData => {
                let p = conn.state.borrow_mut().pending.remove(&h.task);
                match p {
                    Some(Pending::Read {
                        dst: Some(dst),
                        result,
                    }) if dst.len() as u64 == h.length => {
                        conn.answered();
                        // The data follows its header: read ahead with it, or
                        // most likely in the socket already.
                        let mut dst = dst;
                        let ahead = rx.take(dst.len());
                        let n = ahead.len();
                        dst.copy_in(0, ahead);
                        let res = match n < dst.len() {
                            true => {
                                let (res, part) = s.read_exact_expected(dst.slice(n..)).await;
                                dst = part.into_inner();
                                res
                            }
                            false => Ok(()),
                        };
                        // The receive into the destination has been reaped: only
                        // now may the read report, whichever way it ended.
                        drop(dst);
                        if let Err(e) = res {
                            let why = conn.death_reason(&e.to_string());
                            fill(&result, Err(TransferError::ConnectionLost(why.clone())));
                            return Err(TransferError::ConnectionLost(why));
                        }
                        fill(&result, Ok(h.length));
                    }
                    Some(Pending::Read { result, .. }) => {
                        fill(
                            &result,
                            Err(TransferError::BadFrame(
                                "read data of the wrong length".into(),
                            )),
                        );
                        return Err(TransferError::BadFrame(
                            "read data of the wrong length".into(),
                        ));
                    }
                    Some(Pending::Write { result: r, .. }) => {
                        fill(
                            &r,
                            Err(TransferError::BadFrame("read data for a write".into())),
                        );
                        return Err(TransferError::BadFrame("read data for a write".into()));
                    }
                    None => rx.discard(s, h.length, None).await?,
                }
            }
            Opcode::FenceAck => {
                timeline::mark(Step::FenceAckRead);
                let waiters = conn
                    .state
                    .borrow_mut()
                    .fences
                    .remove(&h.batch)
                    .unwrap_or_default();
                if !waiters.is_empty() {
                    conn.answered();
                }
                waiters.iter().for_each(|r| fill(r, Ok(h.offset)));
            }
            Opcode::AuthAck => {
                if h.length as usize > MAX_HANDSHAKE_PAYLOAD {
                    return Err(TransferError::BadFrame("auth ack too large".into()));
                }
                let ack = AuthAck::decode(&rx.payload(s, h.length as usize).await?)?;
                match conn.state.borrow_mut().auths.pop_front() {
                    Some(r) => {
                        conn.answered();
                        fill(&r, Ok(ack))
                    }
                    None => return Err(TransferError::BadFrame("unrequested auth ack".into())),
                }
            }
            Opcode::QpAccept => {
                if h.length as usize > MAX_QP_PAYLOAD {
                    return Err(TransferError::BadFrame("qp accept too large".into()));
                }
                let acc = QpAccept::decode(&rx.payload(s, h.length as usize).await?)?;
                match conn.state.borrow_mut().qp_accepts.pop_front() {
                    Some(r) => {
                        conn.answered();
                        fill(&r, Ok(acc))
                    }
                    None => return Err(TransferError::BadFrame("unrequested qp accept".into())),
                }
            }
            op => {
                return Err(TransferError::BadFrame(format!(
                    "unexpected {op:?} from the target"
                )))
            }
        }
    }
}
