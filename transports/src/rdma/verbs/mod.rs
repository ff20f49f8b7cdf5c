//! Thin owners of libibverbs objects, through `rdma-mummy-sys` (which loads
//! `libibverbs.so.1` at run time: without it every call fails with
//! `EOPNOTSUPP` and device discovery reports no device).
//!
//! All of the RDMA module's `unsafe` lives here. Each wrapper owns one
//! verbs object and frees it on drop, after the objects it depends on are
//! kept alive by an `Rc` (a QP keeps its PD and CQ, an MR its PD, a PD its
//! context).

use std::ffi::CStr;
use std::io;
use std::mem::MaybeUninit;
use std::rc::Rc;

use rdma_mummy_sys as sys;

use super::RdmaError;

mod cq;
mod qp;

pub(crate) use cq::{Completion, Cq};
pub(crate) use qp::{Qp, WorkRequest, SIGNALLED};

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
        // SAFETY: MRs and QPs hold an Rc to the PD (one whose deregistration
        // failed keeps its hold for good), so none is left.
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

thread_local! {
    /// Deregistrations this thread fails on purpose
    /// ([`fail_next_deregistrations`]).
    static FAILING_DEREGISTRATIONS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Makes this thread's next `n` memory-region deregistrations (of any
/// region: a segment's or a local one) fail as a device that refuses them
/// would, the region staying registered for good: a fault for tests of
/// what a revoke does when a key cannot be killed. Never call it outside
/// a test.
#[doc(hidden)]
pub fn fail_next_deregistrations(n: u32) {
    FAILING_DEREGISTRATIONS.with(|f| f.set(n));
}

impl Mr {
    /// Deregisters it (once; later calls do nothing). On an error the
    /// device may still reach the memory: its owner must keep the memory
    /// for good. Nothing else may be called on it afterwards.
    pub(crate) fn deregister(&mut self) -> Result<(), RdmaError> {
        if self.mr.is_null() {
            return Ok(());
        }
        let failing = FAILING_DEREGISTRATIONS.with(|f| {
            let n = f.get();
            f.set(n.saturating_sub(1));
            n > 0
        });
        let rc = if failing {
            // Left registered, as by a device that refused.
            libc::EBUSY
        } else {
            // SAFETY: registered once and not yet deregistered (null after);
            // the owner deregisters only after quiescence.
            unsafe { sys::ibv_dereg_mr(self.mr) }
        };
        self.mr = std::ptr::null_mut();
        if rc == 0 {
            return Ok(());
        }
        // Still registered, for good: its protection domain (and the
        // context it holds) must outlive it, so this region's hold on them
        // is never given back — what `Pd`'s and `Context`'s drops rely on.
        std::mem::forget(self._pd.clone());
        Err(RdmaError::Verbs(
            "ibv_dereg_mr",
            io::Error::from_raw_os_error(rc),
        ))
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Err(e) = self.deregister() {
            tracing::error!(error = %e, "deregistering a memory region failed");
        }
    }
}
