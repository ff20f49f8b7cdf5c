//! The target's side of the local transport: `LocalAttach`, `WriteLocal`
//! and `ReadLocal` on a connection the control server authenticated.

use quiesce_runtime::process::PeerProcess;
use quiesce_runtime::yield_now;

use crate::control::revoke::LandingGuard;
use crate::control::server::{reject, status_frame, Closed, ServedConn};
use crate::control::wire::{Header, Status};
use crate::local::{owner, ADDRESS_PAYLOAD, ATTACH_PAYLOAD, CHUNK};
use crate::memory::Window;
use crate::segment::Rights;
use crate::tcp::serve::cut_short;
use crate::LocalMode;

/// Which way a local request's bytes go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// `WriteLocal`: from the initiator's memory into the segment.
    Pull,
    /// `ReadLocal`: from the segment into the initiator's memory.
    Push,
}

/// What an attached connection holds: the initiator's process, and the
/// buffer its requests' addresses are read into.
pub(crate) struct Attached {
    process: PeerProcess,
    address: Option<Box<[u8]>>,
}

impl Attached {
    /// The initiator's process.
    pub(crate) fn process(&self) -> &PeerProcess {
        &self.process
    }
}

impl ServedConn<'_> {
    /// Attaches the connection to the initiator's process if it proves it
    /// holds this connection and we may reach its memory; answers `Status`:
    /// `Ok` with this process's pid in `length`, or `Forbidden`.
    pub(crate) async fn attach_local(&mut self, h: &Header) -> Result<(), Closed> {
        if h.length != ATTACH_PAYLOAD as u64 {
            return Err(reject(self.s, h, Status::BadFrame, "bad attach payload".into()).await);
        }
        let p = self
            .idle
            .within(self.rx.payload(self.s, ATTACH_PAYLOAD))
            .await??;
        let pid = u32::from_le_bytes(p[0..4].try_into().expect("4 bytes"));
        let probe = u64::from_le_bytes(p[4..12].try_into().expect("8 bytes"));
        let (st, me) = match self.verify(pid, probe) {
            Ok(process) => {
                self.local = Some(Attached {
                    process,
                    address: None,
                });
                (Status::Ok, std::process::id() as u64)
            }
            Err(why) => {
                tracing::debug!(pid, why, "refused a local attach");
                (Status::Forbidden, 0)
            }
        };
        self.send(&status_frame(h, st, me), &[]).await?;
        Ok(())
    }

    fn verify(&mut self, pid: u32, probe: u64) -> Result<PeerProcess, String> {
        if self.engine.config.local == LocalMode::Off {
            return Err("the local transport is off".into());
        }
        // The checks below scan the kernel's socket tables and the
        // process's fds on the reactor: once per connection, and only for
        // a peer that can be on this host.
        if std::mem::replace(&mut self.attach_tried, true) {
            return Err("the connection already tried to attach".into());
        }
        let (mine, theirs) = (
            self.s.local_addr().map_err(|e| e.to_string())?,
            self.s.peer_addr().map_err(|e| e.to_string())?,
        );
        let (ip, peer_ip) = (mine.ip().to_canonical(), theirs.ip().to_canonical());
        if !peer_ip.is_loopback() && peer_ip != ip {
            return Err("the peer is on another host".into());
        }
        if !owner::holds_socket(pid, theirs, mine).map_err(|e| e.to_string())? {
            return Err("that process does not hold this connection".into());
        }
        let process = PeerProcess::open(pid).map_err(|e| e.to_string())?;
        // (After the pidfd: the pid cannot be another process's by now.)
        if let Some(why) = owner::refuses_user(pid).map_err(|e| e.to_string())? {
            return Err(why.into());
        }
        let mut seen = vec![0u8; 16];
        let (_, r) = process.read_into(probe, &mut seen, 16);
        r.map_err(|e| format!("cannot read its memory: {e}"))?;
        if seen != self.nonce {
            return Err("its memory does not hold this connection's nonce".into());
        }
        Ok(process)
    }

    /// Reads a local request's address; `None` with the request refused
    /// `Forbidden` when the connection is not attached.
    async fn local_address(&mut self, h: &Header) -> Result<Option<u64>, Closed> {
        let mut buf = match self.local.as_mut() {
            Some(a) => a.address.take(),
            None => None,
        }
        .unwrap_or_else(|| vec![0u8; ADDRESS_PAYLOAD].into_boxed_slice());
        // Sent with its header: most likely here already. A peer that
        // stops mid-address is closed after the idle limit, as one that
        // stops mid-payload.
        buf = self.idle.within(self.rx.fill(self.s, buf)).await??;
        let addr = u64::from_le_bytes(buf[..].try_into().expect("8 bytes"));
        let exited = match self.local.as_mut() {
            Some(a) => {
                a.address = Some(buf);
                a.process.exited()
            }
            None => {
                self.refuse(h, Status::Forbidden, 0).await?;
                return Ok(None);
            }
        };
        if exited {
            // A request still queued from a process that is gone: its pid
            // may name another process by now, whose memory is not ours to
            // copy. (The copies go by pid; this look narrows the window to
            // the microseconds before the syscall, far below pid reuse.)
            self.refuse(h, Status::Unreachable, 0).await?;
            return Ok(None);
        }
        Ok(Some(addr))
    }

    /// `WriteLocal`: pulls `length` bytes from the initiator's memory into
    /// the segment, chunk by chunk, stopping at a fence or a revoke.
    pub(crate) async fn write_local(&mut self, h: &Header) -> Result<(), Closed> {
        self.copy_local(h, Way::Pull).await
    }

    /// `ReadLocal`: pushes `length` bytes of the segment to the initiator's
    /// memory, chunk by chunk; a fence of the batch stops it (it writes the
    /// initiator's memory, so the fence must cover it).
    pub(crate) async fn read_local(&mut self, h: &Header) -> Result<(), Closed> {
        self.copy_local(h, Way::Push).await
    }

    async fn copy_local(&mut self, h: &Header, way: Way) -> Result<(), Closed> {
        let Some(at) = self.local_address(h).await? else {
            return Ok(());
        };
        let need = match way {
            Way::Pull => Rights::WRITE,
            Way::Push => Rights::READ,
        };
        let (seg, epoch) = match self.check(h, need) {
            Ok(ok) => ok,
            Err(st) => return self.refuse(h, st, 0).await,
        };
        let fence = self.engine.fences.begin_write(self.session, h.batch);
        // Only what lands in the segment answers to its grants.
        let grant =
            (way == Way::Pull).then(|| LandingGuard::begin(&seg, h.offset, h.length, epoch));
        let revoked = || grant.as_ref().is_some_and(LandingGuard::revoked);
        let process = &self.local.as_ref().expect("attached").process;
        let (len, mut moved, mut unreachable) = (h.length, 0u64, false);
        while moved < len && !fence.fenced() && !revoked() {
            // Looked at before every chunk, not only before the first: the
            // copies go by pid, and the request yields between chunks.
            if moved > 0 && process.exited() {
                unreachable = true;
                break;
            }
            let n = (len - moved).min(CHUNK as u64) as usize;
            let mut w = Window::new(seg.inner.mem.clone(), (h.offset + moved) as usize, n);
            let (done, r) = match way {
                Way::Pull => process.read_into(at.wrapping_add(moved), &mut w, n),
                Way::Push => process.write_from(at.wrapping_add(moved), &w),
            };
            moved += done as u64;
            if r.is_err() {
                unreachable = true;
                break;
            }
            if moved < len {
                yield_now().await;
            }
        }
        let cut_by_revoke = moved < len && revoked();
        // No copy runs any more: a fence or revoke waiting for this request
        // may resolve.
        drop((grant, fence, seg));
        let st = match (moved == len, unreachable) {
            (true, _) => Status::Ok,
            (false, true) => Status::Unreachable,
            (false, false) => cut_short(cut_by_revoke, moved),
        };
        if way == Way::Pull {
            let c = &self.engine.counters;
            c.bytes_landed.set(c.bytes_landed.get() + moved);
        }
        self.send(&status_frame(h, st, moved), &[]).await?;
        Ok(())
    }
}
