//! [`Ticket`]: the claim on a batch whose completion is unknown, which
//! keeps its buffers until the batch drains.

use std::future::Future;
use std::panic::resume_unwind;
use std::rc::Rc;
use std::task::Poll;
use std::time::Duration;

#[cfg(doc)]
use super::Submitted;
use super::{Handoff, Quiesced, TaskReport};

/// A claim on a batch whose completion is unknown. It holds the buffers
/// until the batch drains; only [`wait`](Ticket::wait) or
/// [`try_take`](Ticket::try_take) can hand them out, and only once nothing
/// can touch them any more. Dropping it leaves the batch parked in the
/// reactor until it drains; then the buffers are released.
pub struct Ticket<B> {
    pub(super) shared: Rc<Handoff<B>>,
    pub(super) taken: bool,
}

impl<B> std::fmt::Debug for Ticket<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("quiesced", &self.is_quiesced())
            .finish()
    }
}

impl<B> Ticket<B> {
    /// True once the batch has drained (the buffers can be taken). Never,
    /// for a batch a transfer of which panicked (see [`Ticket::wait`]).
    pub fn is_quiesced(&self) -> bool {
        self.shared.finished.get()
    }

    /// Each task as it stood when the batch's completion became unknown, in
    /// the order the tasks were added: `Some(report)` for a task that was
    /// terminal then, whose status and bytes are final (no attempt follows
    /// an unknown completion), `None` for one still in flight. A report's
    /// `remote` is what the target had confirmed by then; the drained
    /// result may confirm more. The buffers stay with the ticket either way.
    pub fn settled(&self) -> Vec<Option<TaskReport>> {
        self.shared.settled.borrow().clone()
    }

    /// The quiescent result, if the batch has drained; the ticket otherwise.
    /// Raises the panic of a transfer of the batch, as [`Ticket::wait`].
    pub fn try_take(mut self) -> Result<Quiesced<B>, Ticket<B>> {
        self.raise_panic();
        let q = self.shared.final_result.borrow_mut().take();
        match q {
            Some(q) => {
                self.taken = true;
                Ok(q)
            }
            None => Err(self),
        }
    }

    /// Waits until the batch drains.
    ///
    /// A transfer of the batch that panicked lost track of a buffer, and
    /// left the target unfenced: the batch can never drain. That panic is
    /// then raised here (once; as from the [`Submitted`] of a batch that
    /// panicked before its completion became unknown), rather than waiting
    /// for ever. What the panic dropped is gone; operations the kernel still
    /// held were parked in their reactor and are released when they end.
    pub async fn wait(mut self) -> Quiesced<B> {
        let q = self.drained().await;
        self.taken = true;
        q
    }

    /// Waits up to `limit` for the batch to drain: its result, or the ticket
    /// back (still holding the buffers) to wait on again later.
    pub async fn wait_for(mut self, limit: Duration) -> Result<Quiesced<B>, Ticket<B>> {
        match quiesce_runtime::time::timeout(limit, self.drained()).await {
            Ok(q) => {
                self.taken = true;
                Ok(q)
            }
            Err(_) => Err(self),
        }
    }

    fn raise_panic(&mut self) {
        let panic = self.shared.panic.borrow_mut().take();
        if let Some(panic) = panic {
            // Nothing is left to collect: dropping this ticket must not
            // mark a batch that is gone abandoned.
            self.taken = true;
            resume_unwind(panic);
        }
    }

    fn drained(&mut self) -> impl Future<Output = Quiesced<B>> + '_ {
        std::future::poll_fn(|cx| {
            self.raise_panic();
            if let Some(q) = self.shared.final_result.borrow_mut().take() {
                return Poll::Ready(q);
            }
            *self.shared.waiter.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
    }
}

impl<B> Drop for Ticket<B> {
    fn drop(&mut self) {
        if !self.taken {
            tracing::debug!("ticket dropped: the batch stays parked until it drains");
            self.shared.abandon();
        }
    }
}
