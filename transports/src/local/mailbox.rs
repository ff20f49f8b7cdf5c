//! The mailbox of an attached connection: small requests and their
//! answers through memory the two processes share, instead of through the
//! socket (DESIGN.md §16.5, PROTOCOL.md §4.7).
//!
//! The initiator makes the mailbox — a sealed memfd and two doorbells
//! (`AF_UNIX` socket pairs) — and names the fd numbers of the memory and of
//! the doorbells' other ends in `LocalMailbox`; the target takes the files
//! from the initiator's process with `pidfd_getfd(2)` (the ptrace access
//! its copies need anyway) and maps the memory. Nothing the initiator does
//! to the files it shares can block the target (see [`Doorbell`]). From then on
//! a write or read of up to [`SLOT_DATA`] bytes on that connection goes
//! into a slot of the mailbox's ring, and its answer comes back in the same
//! slot:
//!
//! * A write's bytes are **copied into the slot** and the target copies
//!   them from there into its segment, after the checks a TCP `Write` gets.
//!   A read's bytes come back in the slot and the initiator copies them out.
//!   So the caller's buffer is never reachable by the other process — as
//!   over TCP, where the kernel holds a copy — and it comes back with the
//!   request's answer, or at once when the connection dies: nothing to lend.
//! * **One stream with the socket.** Requests are published under the
//!   connection's send lock, and the target serves every published request
//!   before it acts on the next frame it reads from the socket. Whatever
//!   the protocol says about the order of a connection's frames (a `Fence`
//!   or `Forget` after a batch's requests) holds for its mailbox too, and a
//!   fence marks the batch so that a request read from a mailbox after it
//!   is refused, as one read from the socket is.
//! * **Wake-ups only for a sleeper.** A reactor about to block sets its
//!   `asleep` word (the source's `arm`); the other side, after publishing,
//!   rings that side's doorbell only if the word is set (a Dekker pair:
//!   each side stores, fences, then loads the other's word). A spinning
//!   reactor finds the work without any syscall on either side.
//!
//! The target trusts nothing in the mapping: it keeps its own count of
//! requests served, refuses a request count that runs ahead of the ring,
//! checks every request as if it came from the socket, and copies a slot's
//! bytes out before using them. Nor does the initiator: its counts start at
//! zero, whatever the mapping says when the offer is answered, and a served
//! count outside the requests it made kills the connection.

use std::io;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use quiesce_runtime::process::PeerProcess;
use std::cell::Cell;
use std::os::fd::{AsRawFd, OwnedFd};

use quiesce_runtime::shm::{Doorbell, SharedMemory};

/// Requests in flight on one mailbox at most.
pub(crate) const SLOTS: u64 = 32;

/// Bytes of a request that fit in a slot: a write's payload or a read's
/// data. Larger requests take the socket (`WriteLocal`/`ReadLocal`).
pub(crate) const SLOT_DATA: usize = 64 * 1024;

/// Bytes of a `LocalMailbox` payload: the fd numbers of the memory and of
/// the two doorbells (to the target, to the initiator), the slot count, and
/// the mailbox's token.
pub(crate) const MAILBOX_PAYLOAD: usize = 32;

/// Words of the ring's head, each on its own cache line.
const SUBMITTED: usize = 0;
/// The mailbox's token (two words), written once by the initiator before
/// it names the files; it shares `SUBMITTED`'s line, read once by the
/// target.
const TOKEN: usize = 8;
const SERVED: usize = 64;
const TARGET_ASLEEP: usize = 128;
const INITIATOR_ASLEEP: usize = 192;
/// Where slot 0 starts.
const RING: usize = 256;
/// A slot: eight words, then the data.
const SLOT_HEAD: usize = 64;
const STRIDE: usize = SLOT_HEAD + SLOT_DATA;

/// The words of a slot. The initiator writes the request's; the target
/// writes `STATUS` and `APPLIED`.
#[derive(Clone, Copy)]
#[repr(usize)]
pub(crate) enum Word {
    /// [`Kind`] as a number.
    Kind = 0,
    /// The request's id, echoed for the initiator's own check.
    Task = 8,
    Batch = 16,
    Segment = 24,
    Offset = 32,
    Length = 40,
    /// The target's [`Status`](crate::control::wire::Status).
    Status = 48,
    /// Bytes written, or read into the slot.
    Applied = 56,
}

/// What a slot asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// Copy the slot's data into the segment.
    Write = 1,
    /// Copy the segment's bytes into the slot.
    Read = 2,
}

impl Kind {
    pub(crate) fn from_word(w: u64) -> Option<Kind> {
        match w {
            1 => Some(Kind::Write),
            2 => Some(Kind::Read),
            _ => None,
        }
    }
}

/// Which end of the mailbox.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum End {
    Initiator,
    Target,
}

/// The bytes of a mailbox of `slots` slots.
pub(crate) fn size(slots: u64) -> usize {
    RING + slots as usize * STRIDE
}

/// One mailbox, as either end maps it.
///
/// The fields drop in order: the memory's fd closes before the doorbells'.
/// [`Mailbox::open`] relies on it.
pub(crate) struct Mailbox {
    mem: SharedMemory,
    /// Which end this is.
    me: End,
    /// Rings the other end (the initiator's end of the doorbell to the
    /// target, or the target's of the one to the initiator).
    to_other: Doorbell,
    /// This end's own, watched.
    to_me: Doorbell,
    /// The initiator's: the doorbells' other ends, named in its offer and
    /// kept open for the target to take.
    named: Option<[OwnedFd; 2]>,
    /// The other end closed this end's doorbell: it will never ring again.
    gone: Cell<bool>,
}

impl Mailbox {
    /// The initiator's new mailbox.
    pub(crate) fn create() -> io::Result<Mailbox> {
        let (to_target, target_end) = Doorbell::pair()?;
        let (to_initiator, initiator_end) = Doorbell::pair()?;
        let mb = Mailbox {
            mem: SharedMemory::create("quiesce-mailbox", size(SLOTS))?,
            me: End::Initiator,
            to_other: to_target,
            to_me: to_initiator,
            named: Some([target_end, initiator_end]),
            gone: Cell::new(false),
        };
        for i in 0..2 {
            let w = crate::control::auth::random_u64();
            mb.mem.word(TOKEN + i * 8).store(w, Ordering::Relaxed);
        }
        Ok(mb)
    }

    /// The target took the files the offer named: the initiator lets its
    /// copies go, so that the target holds the only other end of each
    /// doorbell (and its going hangs this end's up: [`gone`](Self::gone)).
    pub(crate) fn taken(&mut self) {
        self.named = None;
    }

    /// The token in this mailbox's memory.
    fn token(&self) -> [u64; 2] {
        [0, 1].map(|i| self.mem.word(TOKEN + i * 8).load(Ordering::Relaxed))
    }

    /// The `LocalMailbox` payload that shares this mailbox.
    pub(crate) fn payload(&self) -> [u8; MAILBOX_PAYLOAD] {
        let mut p = [0u8; MAILBOX_PAYLOAD];
        let [to_target, to_initiator] = self
            .named
            .as_ref()
            .expect("only the initiator offers its mailbox");
        let fds = [
            self.mem.fd(),
            to_target.as_raw_fd(),
            to_initiator.as_raw_fd(),
        ];
        for (i, fd) in fds.into_iter().enumerate() {
            p[i * 4..i * 4 + 4].copy_from_slice(&(fd as u32).to_le_bytes());
        }
        p[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        for (i, w) in self.token().into_iter().enumerate() {
            p[16 + i * 8..24 + i * 8].copy_from_slice(&w.to_le_bytes());
        }
        p
    }

    /// The target's end of the mailbox that `initiator` named in `payload`.
    ///
    /// The payload names fd numbers, and a number names whatever file the
    /// initiator holds under it *when it is taken*: an initiator that gave
    /// up on the offer (its connect timeout) closed the files, and the
    /// numbers may since name another connection's mailbox. So the memory
    /// must hold the payload's token, and it is taken *after* the
    /// doorbells: the initiator closes the memory first, so memory that
    /// still holds the token proves the doorbells taken before it were the
    /// mailbox's own.
    pub(crate) fn open(initiator: &PeerProcess, payload: &[u8]) -> io::Result<Mailbox> {
        let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        if payload.len() != MAILBOX_PAYLOAD {
            return Err(invalid("a mailbox offer has a 32-byte payload"));
        }
        let field = |i: usize| u32::from_le_bytes(payload[i * 4..i * 4 + 4].try_into().unwrap());
        if field(3) as u64 != SLOTS {
            return Err(invalid(&format!("a mailbox must have {SLOTS} slots")));
        }
        let word =
            |i: usize| u64::from_le_bytes(payload[16 + i * 8..24 + i * 8].try_into().unwrap());
        let take = |i: usize| {
            let fd = i32::try_from(field(i)).map_err(|_| io::ErrorKind::InvalidData)?;
            initiator.take_fd(fd)
        };
        let to_me = Doorbell::open(take(1)?)?;
        let to_other = Doorbell::open(take(2)?)?;
        let mb = Mailbox {
            mem: SharedMemory::open(take(0)?, size(SLOTS))?,
            me: End::Target,
            to_other,
            to_me,
            named: None,
            gone: Cell::new(false),
        };
        if mb.token() != [word(0), word(1)] {
            return Err(invalid(
                "the mailbox's memory does not hold its token: the initiator closed the files it named",
            ));
        }
        Ok(mb)
    }

    /// Requests the initiator has published.
    pub(crate) fn submitted(&self) -> u64 {
        self.mem.word(SUBMITTED).load(Ordering::Acquire)
    }

    /// Requests the target has answered.
    pub(crate) fn served(&self) -> u64 {
        self.mem.word(SERVED).load(Ordering::Acquire)
    }

    /// The initiator publishes requests up to `n` (their slots written).
    pub(crate) fn set_submitted(&self, n: u64) {
        self.mem.word(SUBMITTED).store(n, Ordering::Release);
    }

    /// The target publishes answers up to `n` (their slots written).
    pub(crate) fn set_served(&self, n: u64) {
        self.mem.word(SERVED).store(n, Ordering::Release);
    }

    /// Word `w` of request `seq`'s slot.
    pub(crate) fn word(&self, seq: u64, w: Word) -> &AtomicU64 {
        self.mem.word(slot(seq) + w as usize)
    }

    /// The memory, and where request `seq`'s data lies in it.
    pub(crate) fn data(&self, seq: u64) -> (&SharedMemory, usize) {
        (&self.mem, slot(seq) + SLOT_HEAD)
    }

    fn asleep(&self, end: End) -> &AtomicU64 {
        self.mem.word(match end {
            End::Initiator => INITIATOR_ASLEEP,
            End::Target => TARGET_ASLEEP,
        })
    }

    /// After publishing: rings the other end's doorbell if it is asleep
    /// (or about to be: it drains once more after saying so).
    pub(crate) fn wake(&self) {
        // Pairs with the fence in `sleep`: either the other end sees what
        // was just published, or this sees its word set.
        fence(Ordering::SeqCst);
        let other = match self.me {
            End::Initiator => End::Target,
            End::Target => End::Initiator,
        };
        let w = self.asleep(other);
        if w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::AcqRel) != 0 {
            self.to_other.ring();
        }
    }

    /// This end is about to block: the other must ring. The caller drains
    /// once more after this.
    pub(crate) fn sleep(&self) {
        self.asleep(self.me).store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// This end is awake: no need to ring it.
    pub(crate) fn awake(&self) {
        let w = self.asleep(self.me);
        if w.load(Ordering::Relaxed) != 0 {
            w.store(0, Ordering::Relaxed);
        }
    }

    /// This end's doorbell fd, for its reactor to watch.
    pub(crate) fn bell_fd(&self) -> std::os::fd::RawFd {
        self.to_me.fd()
    }

    /// Quiets this end's doorbell after it rang.
    pub(crate) fn quiet(&self) {
        if !self.to_me.quiet() {
            self.gone.set(true);
        }
    }

    /// The other end closed this end's doorbell (a dead or hostile peer):
    /// it never rings again, and it stays readable — stop serving.
    pub(crate) fn gone(&self) -> bool {
        self.gone.get()
    }
}

/// Where request `seq`'s slot starts.
fn slot(seq: u64) -> usize {
    RING + (seq % SLOTS) as usize * STRIDE
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An initiator that gave up on its offer closed the files it named;
    /// their numbers went to its next mailbox. The target, taking the
    /// numbers late, must not serve that other mailbox as this one.
    #[test]
    fn an_offer_whose_fd_numbers_now_name_another_mailbox_is_refused() {
        let me = PeerProcess::open(std::process::id()).unwrap();
        let first = Mailbox::create().unwrap();
        let offer = first.payload();
        let next = Mailbox::create().unwrap();
        let mut late = offer;
        late[..12].copy_from_slice(&next.payload()[..12]);
        let refused = Mailbox::open(&me, &late)
            .err()
            .expect("served another mailbox");
        assert_eq!(refused.kind(), io::ErrorKind::InvalidData);

        // The offer itself is taken, and its memory is the initiator's.
        let taken = Mailbox::open(&me, &offer).unwrap();
        first.set_submitted(3);
        assert_eq!(taken.submitted(), 3);
        assert_eq!(next.submitted(), 0);
    }
}
