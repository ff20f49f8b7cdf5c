//! The completion queue and its channel.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::ptr;
use std::rc::Rc;

use rdma_mummy_sys as sys;

use super::{Channel, Context};
use crate::rdma::RdmaError;

/// One reaped work completion.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Completion {
    pub(crate) wr_id: u64,
    /// `ibv_wc_status` value (0 = success).
    pub(crate) status: u32,
    pub(crate) qpn: u32,
}

/// The verbs completion queue itself, with its channel: destroyed once its
/// last holder is gone — its [`Cq`] and every [`Qp`] created on it, since
/// the kernel refuses (`EBUSY`) to destroy a CQ a queue pair still uses.
pub(crate) struct CqObject {
    pub(super) cq: *mut sys::ibv_cq,
    _channel: Channel,
}

impl Drop for CqObject {
    fn drop(&mut self) {
        // The channel (a field) is destroyed after the CQ.
        // SAFETY: no QP uses the CQ (each holds this object); `Cq`'s drop acked every event.
        let rc = unsafe { sys::ibv_destroy_cq(self.cq) };
        if rc != 0 {
            tracing::error!(rc, "ibv_destroy_cq failed; the completion queue leaks");
        }
    }
}

/// A completion queue with its channel.
pub(crate) struct Cq {
    obj: Rc<CqObject>,
    cq: *mut sys::ibv_cq,
    channel: *mut sys::ibv_comp_channel,
    /// Events got from the channel and not yet acknowledged.
    unacked: u32,
}

impl Cq {
    pub(crate) fn new(ctx: &Rc<Context>, depth: i32) -> Result<Cq, RdmaError> {
        let channel = ctx.channel()?;
        // SAFETY: `ctx` and the channel are live; the CQ is destroyed first.
        let cq = unsafe { sys::ibv_create_cq(ctx.ctx, depth, ptr::null_mut(), channel.ch, 0) };
        if cq.is_null() {
            return Err(RdmaError::Verbs(
                "ibv_create_cq",
                io::Error::last_os_error(),
            ));
        }
        let ch = channel.ch;
        Ok(Cq {
            obj: Rc::new(CqObject {
                cq,
                _channel: channel,
            }),
            cq,
            channel: ch,
            unacked: 0,
        })
    }

    /// Reaps up to `out.capacity()` completions into `out` (cleared first).
    pub(crate) fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        const N: usize = 32;
        out.clear();
        let mut wcs = [MaybeUninit::<sys::ibv_wc>::uninit(); N];
        // SAFETY: the CQ is live; `wcs` has room for N entries.
        let n = unsafe { sys::ibv_poll_cq(self.cq, N as i32, wcs.as_mut_ptr().cast()) };
        for wc in wcs.iter().take(n.max(0) as usize) {
            // SAFETY: the first `n` entries were written by poll_cq.
            let wc = unsafe { wc.assume_init_ref() };
            out.push(Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                qpn: wc.qp_num,
            });
        }
        out.len()
    }

    /// Entries the CQ holds (the device may round the size asked for up).
    pub(crate) fn capacity(&self) -> u32 {
        // SAFETY: the CQ is live; `cqe` is set by ibv_create_cq.
        unsafe { (*self.cq).cqe.max(1) as u32 }
    }

    /// Requests an event on the channel for the next completion.
    pub(crate) fn arm(&mut self) {
        // SAFETY: the CQ is live.
        unsafe { sys::ibv_req_notify_cq(self.cq, 0) };
    }

    /// The channel's fd.
    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: the channel is live.
        unsafe { (*self.channel).fd }
    }

    /// Consumes every pending channel event (the fd is non-blocking).
    pub(crate) fn consume_events(&mut self) {
        loop {
            let mut cq = ptr::null_mut();
            let mut cq_ctx = ptr::null_mut();
            // SAFETY: the channel is live; out-pointers are valid.
            if unsafe { sys::ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } != 0 {
                break;
            }
            self.unacked += 1;
        }
        if self.unacked >= 64 {
            // SAFETY: acknowledges events got from this CQ's channel.
            unsafe { sys::ibv_ack_cq_events(self.cq, self.unacked) };
            self.unacked = 0;
        }
    }

    /// The CQ object, for a queue pair to hold while it uses the CQ.
    pub(crate) fn object(&self) -> Rc<CqObject> {
        self.obj.clone()
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        if self.unacked > 0 {
            // SAFETY: acknowledges events got from this CQ's channel; the CQ
            // lives on in `obj` (and in the QPs still using it).
            unsafe { sys::ibv_ack_cq_events(self.cq, self.unacked) };
        }
    }
}
