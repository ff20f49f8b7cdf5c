//! The reliable-connected queue pair: state transitions and posting.

use std::cell::RefCell;
use std::io;
use std::ptr;
use std::rc::Rc;

use rdma_mummy_sys as sys;

use super::{cq::CqObject, Access, Pd, QpEndpoint, PORT};
use crate::rdma::RdmaError;

/// Set in a [`WorkRequest`]'s `wr_id` to ask for a completion on success
/// (`IBV_SEND_SIGNALED`; the QP is created with `sq_sig_all = 0`). Errors
/// complete either way. The bit travels with the `wr_id` into the
/// completion, which tells the reaper which request it was.
pub(crate) const SIGNALLED: u64 = 1 << 63;

/// One RDMA WRITE or READ to post.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkRequest {
    pub(crate) wr_id: u64,
    pub(crate) read: bool,
    pub(crate) local: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
    pub(crate) remote: u64,
    pub(crate) rkey: u32,
    /// Small writes are copied into the WQE (no local key needed for them).
    pub(crate) inline: bool,
}

impl WorkRequest {
    /// Whether it asks for a completion on success ([`SIGNALLED`]).
    pub(crate) fn signalled(&self) -> bool {
        self.wr_id & SIGNALLED != 0
    }
}

/// A send work request with every field zero (null pointers, no flags).
fn blank_send_wr() -> sys::ibv_send_wr {
    // SAFETY: ibv_send_wr is plain C data; all-zero is a valid value of it.
    unsafe { std::mem::zeroed() }
}

/// A reliable-connected queue pair.
pub(crate) struct Qp {
    qp: *mut sys::ibv_qp,
    pd: Rc<Pd>,
    /// The CQ its completions go to: destroyed only after the QP.
    _cq: Rc<CqObject>,
    pub(crate) max_inline: u32,
    /// Reused SGE and work request arrays of `post`.
    scratch: RefCell<(Vec<sys::ibv_sge>, Vec<sys::ibv_send_wr>)>,
}

impl Qp {
    /// Creates an RC QP whose send queue holds `depth` requests, and one
    /// more: the spare entry of the marker a refused post may need (see the
    /// ledger's docs), which a link's own accounting never fills.
    pub(crate) fn new(pd: &Rc<Pd>, cq_obj: Rc<CqObject>, depth: u32) -> Result<Qp, RdmaError> {
        let cq = cq_obj.cq;
        // SAFETY: an all-zero init attr is valid; fields set below.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = depth + 1;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = 64;
        // Only requests posted with IBV_SEND_SIGNALED complete on success.
        init.sq_sig_all = 0;
        // SAFETY: the PD and the CQ are live (the caller keeps the CQ's owner
        // alive for as long as the QP).
        let qp = unsafe { sys::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(RdmaError::Verbs(
                "ibv_create_qp",
                io::Error::last_os_error(),
            ));
        }
        Ok(Qp {
            qp,
            pd: pd.clone(),
            _cq: cq_obj,
            max_inline: init.cap.max_inline_data,
            scratch: RefCell::default(),
        })
    }

    /// The queue pair number.
    pub(crate) fn qpn(&self) -> u32 {
        // SAFETY: valid until drop.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        what: &'static str,
    ) -> Result<(), RdmaError> {
        // SAFETY: the QP is live; `attr` is fully initialised for `mask`.
        let rc = unsafe { sys::ibv_modify_qp(self.qp, attr, mask as i32) };
        if rc != 0 {
            return Err(RdmaError::Verbs(what, io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS towards `remote`, sending from `local`.
    pub(crate) fn connect(
        &self,
        local: &QpEndpoint,
        remote: &QpEndpoint,
        sgid_index: u8,
        remote_access: Access,
    ) -> Result<(), RdmaError> {
        use sys::ibv_qp_attr_mask as M;
        // SAFETY: all-zero attrs are valid; the fields each mask names are set.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = PORT;
        a.pkey_index = 0;
        let mut acc = 0;
        if remote_access.remote_write {
            acc |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if remote_access.remote_read {
            acc |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        a.qp_access_flags = acc;
        self.modify(
            &mut a,
            (M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS).0,
            "modify_qp(INIT)",
        )?;

        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = local.mtu.min(remote.mtu) as sys::ibv_mtu::Type;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        a.ah_attr.port_num = PORT;
        a.ah_attr.dlid = remote.lid;
        if self.pd.ctx.ethernet || remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = sys::ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = sgid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut a,
            (M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER)
                .0,
            "modify_qp(RTR)",
        )?;

        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = local.psn;
        // 4.096 µs × 2^14 ≈ 67 ms per try, 7 tries: a vanished peer fails
        // its requests in about half a second.
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 16;
        self.modify(
            &mut a,
            (M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC)
                .0,
            "modify_qp(RTS)",
        )
    }

    /// Moves the QP to the error state: outstanding requests complete with
    /// `WR_FLUSH_ERR`, and a responder accepts no further packet.
    pub(crate) fn set_error(&self) -> Result<(), RdmaError> {
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut a,
            sys::ibv_qp_attr_mask::IBV_QP_STATE.0,
            "modify_qp(ERR)",
        )
    }

    /// Posts `wrs` with one `ibv_post_send` (one doorbell). On failure returns
    /// how many of them were posted and the error.
    pub(crate) fn post(&self, wrs: &[WorkRequest]) -> Result<(), (usize, RdmaError)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut scratch = self.scratch.borrow_mut();
        let (sges, list) = &mut *scratch;
        sges.clear();
        sges.extend(wrs.iter().map(|w| sys::ibv_sge {
            addr: w.local,
            length: w.len,
            lkey: w.lkey,
        }));
        list.clear();
        list.extend(wrs.iter().map(|_| blank_send_wr()));
        let base = list.as_mut_ptr();
        let sge_base = sges.as_mut_ptr();
        for (i, w) in wrs.iter().enumerate() {
            let e = &mut list[i];
            e.wr_id = w.wr_id;
            // SAFETY: `i` is within `sges`, which has one entry per request.
            e.sg_list = unsafe { sge_base.add(i) };
            e.num_sge = 1;
            e.opcode = if w.read {
                sys::ibv_wr_opcode::IBV_WR_RDMA_READ
            } else {
                sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE
            };
            let mut flags = if w.signalled() {
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            if w.inline && !w.read && w.len <= self.max_inline {
                flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            e.send_flags = flags;
            e.wr.rdma = sys::rdma_t {
                remote_addr: w.remote,
                rkey: w.rkey,
            };
            e.next = if i + 1 < wrs.len() {
                // SAFETY: `i + 1 < len`: inside `list`.
                unsafe { base.add(i + 1) }
            } else {
                ptr::null_mut()
            };
        }
        let mut bad = ptr::null_mut();
        // SAFETY: the chain and its SGEs live until the call returns (verbs
        // copies them into the send queue); the QP is live.
        let rc = unsafe { sys::ibv_post_send(self.qp, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        // An error with no `bad` request: rxe answers so when its doorbell
        // failed after every request went into the send queue (or, for a
        // QP without one, before any did). Counted as all posted: then they
        // flush once the QP is moved to error, and nothing is released on
        // the guess that the NIC never saw them (a broken QP's batch ends
        // unknown instead).
        let posted = if bad.is_null() {
            wrs.len()
        } else {
            // SAFETY: `bad` points into `list` when set.
            (unsafe { bad.offset_from(base) }) as usize
        };
        Err((
            posted,
            RdmaError::Verbs("ibv_post_send", io::Error::from_raw_os_error(rc)),
        ))
    }
}

impl Qp {
    /// Destroys it now, saying whether the device did: a destroyed queue
    /// pair accepts no packet. On an error it lives on, in whatever state
    /// it was, and is left alone for good (with the domain and completion
    /// queue it uses).
    pub(crate) fn destroy(mut self) -> Result<(), RdmaError> {
        let qp = std::mem::replace(&mut self.qp, ptr::null_mut());
        // SAFETY: the owner destroys a QP only after its requests were
        // reaped; `qp` is live and nulled above, so never destroyed twice.
        let rc = unsafe { sys::ibv_destroy_qp(qp) };
        if rc == 0 {
            return Ok(());
        }
        self.leak();
        Err(RdmaError::Verbs(
            "ibv_destroy_qp",
            io::Error::from_raw_os_error(rc),
        ))
    }

    /// Leaves it alive for good, as a device that refused to destroy it
    /// would: its domain and completion queue stay too.
    pub(crate) fn leak(mut self) {
        self.qp = ptr::null_mut();
        std::mem::forget(self.pd.clone());
        std::mem::forget(self._cq.clone());
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if self.qp.is_null() {
            return;
        }
        // SAFETY: the owner destroys a QP only after its requests were reaped.
        unsafe { sys::ibv_destroy_qp(self.qp) };
    }
}
