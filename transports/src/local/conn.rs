//! The initiator's side of the local transport on one connection:
//! attaching it to the target's process, and requests that name this
//! process's memory instead of carrying bytes.

use std::cell::RefCell;
use std::rc::Rc;

use quiesce_runtime::process::PeerProcess;
use quiesce_runtime::time::timeout;

use crate::control::frame::send_frame;
use crate::control::wire::{Header, Opcode};
use crate::error::TransferError;
use crate::local::loan::Request;
use crate::local::mailbox::{Mailbox, MAILBOX_PAYLOAD};
use crate::local::outbox::Outbox;
use crate::local::{owner, ATTACH_PAYLOAD};
use crate::tcp::conn::{Conn, SendGuard};
use crate::tcp::peer::PeerParams;
use crate::tcp::responses::{wait, Pending, Reply};
use crate::LocalMode;

impl Conn {
    /// True once the connection is attached: its data moves by
    /// cross-memory attach.
    pub(crate) fn is_local(&self) -> bool {
        self.local.get()
    }

    /// Attaches the connection to this process for the local transport:
    /// the target checks that we hold the connection and that it can read
    /// our memory (our copy of its nonce); we check that the process it
    /// names holds the other end and may write our memory (it runs as our
    /// user, or root). Returns that process.
    pub(crate) async fn attach_local(&self) -> Result<PeerProcess, TransferError> {
        let (local, remote) = (self.stream.local_addr()?, self.stream.peer_addr()?);
        if !(local.ip() == remote.ip() || local.ip().is_loopback() && remote.ip().is_loopback()) {
            return Err(refused("the peer is not on this host"));
        }
        let mut payload = [0u8; ATTACH_PAYLOAD];
        payload[0..4].copy_from_slice(&std::process::id().to_le_bytes());
        // The target's nonce, in this connection (alive as long as the
        // connection, which outlives the request).
        let probe = self.hello.nonce.as_ptr() as u64;
        payload[4..12].copy_from_slice(&probe.to_le_bytes());
        let h = Header {
            length: ATTACH_PAYLOAD as u64,
            ..Header::new(Opcode::LocalAttach)
        };
        let result = self.reply();
        let g = self.send_guard().await;
        self.request(g, h, &payload, &result, None).await?;
        let sent = wait(&result).await;
        let pid = match sent {
            Ok(pid) => u32::try_from(pid).map_err(|_| refused("a pid out of range"))?,
            Err(TransferError::Forbidden(_)) => return Err(refused("the target refused")),
            Err(e) => return Err(e),
        };
        if !owner::holds_socket(pid, remote, local)? {
            return Err(refused(
                "the process the target named does not hold the connection",
            ));
        }
        let process = PeerProcess::open(pid)?;
        // (After the pidfd: the pid cannot be another process's by now.)
        // Its answers say it copied into this process's memory: a process
        // that cannot would have a read's spare capacity marked filled.
        if !owner::may_write_here(pid)? {
            return Err(refused("the target's process runs as another user"));
        }
        self.local.set(true);
        Ok(process)
    }

    /// Offers the target a mailbox for this connection's small requests
    /// (`crate::local::mailbox`); they go through it once the target took
    /// it. `Err`: the target refused (or the connection died): they stay on
    /// the socket.
    pub(crate) async fn open_mailbox(self: &Rc<Self>) -> Result<(), TransferError> {
        let mut mb = Mailbox::create()?;
        let h = Header {
            length: MAILBOX_PAYLOAD as u64,
            ..Header::new(Opcode::LocalMailbox)
        };
        let result = self.reply();
        let g = self.send_guard().await;
        // `mb` holds the files open until the target has taken them.
        self.request(g, h, &mb.payload(), &result, None).await?;
        wait(&result).await?;
        mb.taken();
        let _ = self.outbox.set(Outbox::new(mb, self));
        Ok(())
    }

    /// Sends `req` under the send guard `g`, its answer to fill `result`.
    /// `Err`: nothing was sent (the connection was dead, or the batch was
    /// fenced here). `Ok`: the answer, or the connection's end, fills
    /// `result`. The request is registered before the first suspension.
    pub(crate) async fn send_local(
        &self,
        mut g: SendGuard<'_>,
        req: &Request,
        result: &Reply<Result<u64, TransferError>>,
    ) -> Result<(), TransferError> {
        if req.op == Opcode::WriteLocal && self.refuses_write(&mut g, req.to) {
            return Err(TransferError::Revoked { landed: 0 });
        }
        let h = Header {
            batch: req.batch,
            segment: req.to.id,
            offset: req.offset,
            length: req.len,
            ..Header::new(req.op)
        };
        self.request(g, h, &req.addr.to_le_bytes(), result, Some(req.len))
            .await
    }

    /// Sends `h` (its `task` set to a new request id) with `payload` under
    /// `g`, its answer to fill `result`, as [`send_local`](Self::send_local);
    /// `moves`: the bytes it moves, which its answer may count no more of.
    async fn request(
        &self,
        mut g: SendGuard<'_>,
        mut h: Header,
        payload: &[u8],
        result: &Reply<Result<u64, TransferError>>,
        moves: Option<u64>,
    ) -> Result<(), TransferError> {
        h.task = self.new_id();
        if self
            .register(
                h.task,
                Pending::Write {
                    len: moves,
                    result: result.clone(),
                },
            )
            .is_err()
        {
            g.complete = true;
            return Err(self.lost());
        }
        if self.fenced_locally(&mut g, h.task, h.batch) {
            return Err(TransferError::Fenced);
        }
        let sent = send_frame(&self.stream, &h, payload).await;
        g.complete = sent.is_ok();
        drop(g);
        if let Err(e) = sent {
            // The reader fills the slot once the connection has ended.
            self.kill(&e.to_string());
        }
        Ok(())
    }
}

/// Attaches data connection `c` for the local transport when `p.local`
/// allows it, the target's process going into `known`, and offers the
/// target a mailbox when `p.mailbox` says so; a refusal leaves the
/// connection on TCP (or, `Required`, fails it).
pub(crate) async fn attach_data(
    c: &Rc<Conn>,
    p: &PeerParams,
    known: &RefCell<Option<Rc<PeerProcess>>>,
) -> Result<(), TransferError> {
    let (mode, limit) = (p.local, p.connect_timeout);
    if mode == LocalMode::Off {
        return Ok(());
    }
    let attached = match timeout(limit, c.attach_local()).await {
        Ok(r) => r,
        Err(_) => Err(TransferError::ConnectTimeout),
    };
    match attached {
        Ok(process) => {
            {
                let mut known = known.borrow_mut();
                match known.as_ref() {
                    // Loans wait on the process that holds the connections;
                    // another one while it lives would make that unsound.
                    Some(p) if p.pid() != process.pid() && !p.exited() => {
                        c.kill("the target's process changed");
                        return Err(TransferError::ConnectionLost(
                            "the target's connections are held by different processes".into(),
                        ));
                    }
                    // The same process (a pid reused by a new target after
                    // the old one exited is not: its loans must wait on the
                    // live one, and `released` looks at this one).
                    Some(p) if p.pid() == process.pid() && !p.exited() => {}
                    // The first attach, or a target that restarted.
                    _ => *known = Some(Rc::new(process)),
                }
            }
            if p.mailbox {
                match timeout(limit, c.open_mailbox()).await {
                    Ok(Ok(())) => {}
                    // Refused, the connection goes on with small requests
                    // on the socket; one that died with the offer is no
                    // connection to install.
                    Ok(Err(e)) if c.is_dead() => return Err(e),
                    Ok(Err(e)) => tracing::debug!(error = %e, "small requests stay on the socket"),
                    Err(_) => {
                        c.kill("no answer to the mailbox offer within the connect timeout");
                        return Err(TransferError::ConnectTimeout);
                    }
                }
            }
            Ok(())
        }
        Err(e) if mode == LocalMode::Required => {
            c.kill("the local transport is required and the attach failed");
            Err(e)
        }
        Err(e) => {
            tracing::debug!(error = %e, "staying on TCP");
            Ok(())
        }
    }
}

fn refused(why: &str) -> TransferError {
    TransferError::handshake("local attach", why)
}
