//! A buffer lent to the target by a local request, and how it comes back.
//!
//! Over TCP a buffer is safe once this side's own operations are reaped:
//! the kernel copied the bytes. Here the target's process reads (writes)
//! the buffer itself, so the buffer is safe only once the target let go of
//! the request: it answered, or — the connection lost first — it confirmed
//! a fence of the batch (its copies of the batch have stopped and none
//! starts), or its process has exited. Until then the buffer stays lent,
//! also when the request's future is dropped: the loan then moves into a
//! task of its own that waits as the future would have.

use std::rc::Rc;
use std::time::Duration;

use quiesce_runtime::time::{sleep, timeout};
use quiesce_runtime::{strand, try_spawn_local};

use crate::control::wire::Opcode;
use crate::error::TransferError;
use crate::tcp::conn::{Conn, SegmentGrant};
use crate::tcp::peer::Peer;
use crate::tcp::responses::{wait, Reply};

/// Where the target reaches a lent buffer, and what it does there.
pub(crate) struct Request {
    pub(crate) op: Opcode,
    pub(crate) batch: u64,
    /// The segment, and (a `WriteLocal`'s) its handle's grant epoch.
    pub(crate) to: SegmentGrant,
    pub(crate) offset: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

/// How far a loan's request got.
enum Stage {
    /// Nothing of the request reached the target.
    Unsent,
    /// Sent (or being sent): its answer, or its connection's end, fills
    /// the slot.
    Asked(Reply<Result<u64, TransferError>>),
    /// Its connection ended without an answer: waiting for the target to
    /// confirm a fence of the batch, or to exit.
    Releasing,
}

/// A buffer lent to the target for one local request.
struct Loan<T: 'static> {
    held: Option<T>,
    peer: Peer,
    batch: u64,
    stage: Stage,
}

impl<T: 'static> Drop for Loan<T> {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        // The future was dropped with the buffer lent: wait for the target
        // to let go in a task of its own.
        let asked = match std::mem::replace(&mut self.stage, Stage::Unsent) {
            Stage::Unsent => return,
            Stage::Asked(reply) => Some(reply),
            Stage::Releasing => None,
        };
        let (peer, batch) = (self.peer.clone(), self.batch);
        let held = StillLent(Some(held));
        let waits = async move {
            let answered = match asked {
                Some(reply) => !wait(&reply).await.as_ref().is_err_and(unsettled),
                None => false,
            };
            if !answered {
                released(&peer, batch).await;
            }
            drop(held.let_go());
        };
        if let Err(f) = try_spawn_local(waits) {
            // No runtime to wait on: leak the buffer rather than free it
            // while the target may still reach it.
            strand(f);
        }
    }
}

/// A lent buffer in the task that waits for the target to let go of it:
/// freed through [`let_go`](Self::let_go) only. Dropped before that — its
/// task dropped, as a runtime's shutdown drops every task — it is
/// stranded: leaked, and counted in the shutdown's undrained total.
struct StillLent<T>(Option<T>);

impl<T> StillLent<T> {
    /// The target let go: the buffer is the caller's again.
    fn let_go(mut self) -> T {
        self.0.take().expect("let go once")
    }
}

impl<T> Drop for StillLent<T> {
    fn drop(&mut self) {
        if let Some(held) = self.0.take() {
            strand(held);
        }
    }
}

/// True if the target did not answer the request: it may still be copying.
fn unsettled(e: &TransferError) -> bool {
    !e.settles_remote()
}

/// Runs `req` on the attached connection `conn`, lending it `held` (the
/// buffer `req.addr` points into); gives `held` back once the target let go.
pub(crate) async fn lend<T: 'static>(
    peer: &Peer,
    conn: Rc<Conn>,
    req: Request,
    held: T,
) -> (Result<u64, TransferError>, T) {
    let mut loan = Loan {
        held: Some(held),
        peer: peer.clone(),
        batch: req.batch,
        stage: Stage::Unsent,
    };
    let reply = conn.reply();
    let g = conn.send_guard().await;
    // From here until `send_local` registers the request there is no
    // suspension point, so a dropped future finds it registered.
    loan.stage = Stage::Asked(reply.clone());
    let res = match conn.send_local(g, &req, &reply).await {
        Ok(()) => wait(&reply).await,
        Err(e) => {
            loan.stage = Stage::Unsent;
            Err(e)
        }
    };
    if res.as_ref().is_err_and(unsettled) {
        loan.stage = Stage::Releasing;
        released(peer, req.batch).await;
    }
    loan.stage = Stage::Unsent;
    conn.recycle(reply);
    let held = loan.held.take().expect("the loan holds the buffer");
    (res, held)
}

/// Resolves once the target will not touch memory lent for `batch` any
/// more: it confirmed a fence of the batch, or its process exited. Retries
/// (reconnecting) until one of them happens; a stopped target keeps it
/// waiting, which a batch's deadline reports as completion unknown.
pub(crate) async fn released(peer: &Peer, batch: u64) {
    let mut pause = Duration::from_millis(1);
    loop {
        if peer.target_process().is_some_and(|p| p.exited()) {
            return;
        }
        match timeout(peer.connect_timeout(), peer.fence(batch)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => tracing::debug!(error = %e, batch, "waiting for a local loan"),
            Err(_) => tracing::debug!(batch, "no fence ack yet for a local loan"),
        }
        sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}
