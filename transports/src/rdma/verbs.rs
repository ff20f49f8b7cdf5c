//! Thin owners of libibverbs objects, through `rdma-mummy-sys` (which loads
//! `libibverbs.so.1` at run time: without it every call fails with
//! `EOPNOTSUPP` and device discovery reports no device).
//!
//! All of the RDMA module's `unsafe` lives here. Each wrapper owns one
//! verbs object and frees it on drop, after the objects it depends on are
//! kept alive by an `Rc` (a QP keeps its PD and CQ, an MR its PD, a PD its
//! context).

use std::cell::RefCell;
use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::ptr;
use std::rc::Rc;

use rdma_mummy_sys as sys;

use super::RdmaError;

/// The port every device is used through (RoCE NICs and rxe have one).
pub(crate) const PORT: u8 = 1;

/// How a queue pair is reached: the struct the handshake carries
/// (`QpConnect`/`QpAccept`), used as it is.
pub type QpEndpoint = crate::control::wire::QpWire;

/// Names of the RDMA devices on this machine.
pub fn device_names() -> Result<Vec<String>, RdmaError> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        return Err(RdmaError::NoDevice(match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) => "libibverbs.so.1 could not be loaded".into(),
            Some(libc::ENOSYS) => "the kernel has no RDMA (ib_uverbs) support".into(),
            _ => format!("ibv_get_device_list: {e}"),
        }));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let dev = unsafe { *list.add(i) };
        // SAFETY: `dev` is valid while the list is; the name is a C string.
        let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { sys::ibv_free_device_list(list) };
    Ok(names)
}

/// An open device context and its port's attributes.
pub struct Context {
    ctx: *mut sys::ibv_context,
    name: String,
    /// `ibv_mtu` value of the port's active MTU.
    pub(crate) active_mtu: u8,
    pub(crate) lid: u16,
    pub(crate) ethernet: bool,
    pub(crate) gid_table_len: u32,
    pub(crate) max_msg: u32,
}

impl Context {
    /// Opens device `name`, or the first device with an active port.
    pub fn open(name: Option<&str>) -> Result<Rc<Context>, RdmaError> {
        let names = device_names()?;
        if names.is_empty() {
            return Err(RdmaError::NoDevice("no RDMA device on this machine".into()));
        }
        let mut n = 0;
        // SAFETY: as in `device_names`; freed before returning.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(RdmaError::NoDevice("device list vanished".into()));
        }
        let mut found = Err(RdmaError::NoDevice(match name {
            Some(n) => format!("no RDMA device named {n:?} (have {names:?})"),
            None => format!("no RDMA device with an active port (have {names:?})"),
        }));
        for (i, dev_name) in names.iter().enumerate().take(n.max(0) as usize) {
            if name.is_some_and(|want| want != dev_name) {
                continue;
            }
            // SAFETY: index within the list's `n` entries.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` is valid while the list is; the context outlives it.
            let ctx = unsafe { sys::ibv_open_device(dev) };
            if ctx.is_null() {
                found = Err(RdmaError::Verbs(
                    "ibv_open_device",
                    io::Error::last_os_error(),
                ));
                continue;
            }
            let mut attr = MaybeUninit::<sys::ibv_port_attr>::zeroed();
            // SAFETY: `ctx` is open; `attr` is a writable port_attr.
            let rc = unsafe { sys::ibv_query_port(ctx, PORT, attr.as_mut_ptr()) };
            // SAFETY: zeroed is a valid port_attr; filled on success.
            let attr = unsafe { attr.assume_init() };
            if rc != 0 || attr.state != sys::ibv_port_state::IBV_PORT_ACTIVE {
                // SAFETY: opened above, closed once.
                unsafe { sys::ibv_close_device(ctx) };
                if rc != 0 {
                    found = Err(RdmaError::Verbs(
                        "ibv_query_port",
                        io::Error::from_raw_os_error(rc),
                    ));
                } else if name.is_some() {
                    found = Err(RdmaError::NoDevice(format!(
                        "{dev_name}: port {PORT} is not active"
                    )));
                }
                continue;
            }
            found = Ok(Rc::new(Context {
                ctx,
                name: dev_name.clone(),
                active_mtu: attr.active_mtu as u8,
                lid: attr.lid,
                ethernet: attr.link_layer == 2, // IBV_LINK_LAYER_ETHERNET
                gid_table_len: attr.gid_tbl_len.max(0) as u32,
                max_msg: attr.max_msg_sz,
            }));
            break;
        }
        // SAFETY: from ibv_get_device_list; contexts opened from it stay valid.
        unsafe { sys::ibv_free_device_list(list) };
        found
    }

    /// The device's name (`rxe0`, `mlx5_0`…).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// GID `index` of the port and whether it is a RoCE v2 IPv4-mapped one.
    pub(crate) fn gid(&self, index: u32) -> Option<([u8; 16], bool)> {
        let mut entry = MaybeUninit::<sys::ibv_gid_entry>::zeroed();
        // SAFETY: `ctx` is open; `entry` is writable and sized for the call.
        let rc =
            unsafe { sys::ibv_query_gid_ex(self.ctx, PORT as u32, index, entry.as_mut_ptr(), 0) };
        if rc == 0 {
            // SAFETY: filled by a successful call.
            let e = unsafe { entry.assume_init() };
            // SAFETY: every bit pattern is a valid `raw` view of the union.
            let raw = unsafe { e.gid.raw };
            return Some((
                raw,
                e.gid_type == sys::IBV_GID_TYPE_ROCE_V2 && ipv4_mapped(&raw),
            ));
        }
        let mut gid = MaybeUninit::<sys::ibv_gid>::zeroed();
        // SAFETY: as above, the older query.
        let rc = unsafe { sys::ibv_query_gid(self.ctx, PORT, index as i32, gid.as_mut_ptr()) };
        // SAFETY: zeroed or filled; `raw` covers the union.
        let raw = unsafe { gid.assume_init().raw };
        (rc == 0 && raw != [0; 16]).then(|| (raw, ipv4_mapped(&raw)))
    }

    /// A completion channel: its fd becomes readable after an armed CQ
    /// gets a completion.
    pub(crate) fn channel(self: &Rc<Self>) -> Result<Channel, RdmaError> {
        // SAFETY: `ctx` is open.
        let ch = unsafe { sys::ibv_create_comp_channel(self.ctx) };
        if ch.is_null() {
            return Err(RdmaError::Verbs(
                "ibv_create_comp_channel",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `ch` is valid; its fd is ours to make non-blocking.
        let fd = unsafe { (*ch).fd };
        // SAFETY: plain fcntl on a valid fd.
        unsafe {
            libc::fcntl(
                fd,
                libc::F_SETFL,
                libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
            )
        };
        Ok(Channel {
            ch,
            _ctx: self.clone(),
        })
    }
}

fn ipv4_mapped(g: &[u8; 16]) -> bool {
    g[..10] == [0; 10] && g[10..12] == [0xff, 0xff]
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object made from the context holds an Rc to it, so
        // none is left when this runs.
        unsafe { sys::ibv_close_device(self.ctx) };
    }
}

/// A completion channel.
pub(crate) struct Channel {
    ch: *mut sys::ibv_comp_channel,
    _ctx: Rc<Context>,
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: the CQ using it holds an Rc to the channel and is gone.
        unsafe { sys::ibv_destroy_comp_channel(self.ch) };
    }
}

/// A protection domain.
pub struct Pd {
    pd: *mut sys::ibv_pd,
    ctx: Rc<Context>,
}

impl Pd {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Rc<Context>) -> Result<Rc<Pd>, RdmaError> {
        // SAFETY: `ctx` is open.
        let pd = unsafe { sys::ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(RdmaError::Verbs("ibv_alloc_pd", io::Error::last_os_error()));
        }
        Ok(Rc::new(Pd {
            pd,
            ctx: ctx.clone(),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Rc to the PD, so none is left.
        unsafe { sys::ibv_dealloc_pd(self.pd) };
    }
}

/// Access a memory region grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Peers may RDMA-write into it.
    pub remote_write: bool,
    /// Peers may RDMA-read from it.
    pub remote_read: bool,
}

impl Access {
    /// Local use only (an initiator's buffers, its queue pairs).
    pub const LOCAL: Access = Access {
        remote_write: false,
        remote_read: false,
    };
}

/// A registered memory region. Dropping it deregisters it: the caller
/// must drop it only once no work request can touch it.
pub struct Mr {
    mr: *mut sys::ibv_mr,
    _pd: Rc<Pd>,
}

impl Mr {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The memory must stay allocated until the returned region is dropped.
    pub unsafe fn register(
        pd: &Rc<Pd>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Mr, RdmaError> {
        let mut flags = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if access.remote_write {
            flags |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if access.remote_read {
            flags |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        // SAFETY: the caller keeps [addr, addr + len) allocated; the PD is live.
        let mr = unsafe { sys::ibv_reg_mr(pd.pd, addr.cast(), len, flags as i32) };
        if mr.is_null() {
            return Err(RdmaError::Verbs("ibv_reg_mr", io::Error::last_os_error()));
        }
        Ok(Mr {
            mr,
            _pd: pd.clone(),
        })
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: `mr` is valid until drop.
        unsafe { (*self.mr).lkey }
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        // SAFETY: as above.
        unsafe { (*self.mr).addr as u64 }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.mr).length }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once; the owner drops it only after quiescence.
        unsafe { sys::ibv_dereg_mr(self.mr) };
    }
}

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
    cq: *mut sys::ibv_cq,
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
    /// Creates an RC QP whose send queue holds `depth` requests.
    pub(crate) fn new(pd: &Rc<Pd>, cq_obj: Rc<CqObject>, depth: u32) -> Result<Qp, RdmaError> {
        let cq = cq_obj.cq;
        // SAFETY: an all-zero init attr is valid; fields set below.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = depth;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = 64;
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
            let mut flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
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
        let posted = if bad.is_null() {
            0
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

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the owner destroys a QP only after its requests were reaped.
        unsafe { sys::ibv_destroy_qp(self.qp) };
    }
}
