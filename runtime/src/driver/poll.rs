//! The epoll backend (through `mio`): the same operations as non-blocking
//! syscalls, retried when epoll reports the fd ready.
//!
//! fds are registered once, edge-triggered, for both directions, and stay
//! registered until their owner (a socket, an `Fd`, a timer) forgets them on
//! drop. An op that hits `EWOULDBLOCK` leaves its waker on the fd; the next
//! edge in that direction wakes every waiter, and each retries its syscall.

use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::task::Waker;
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest as MioInterest, Poll, Token};
use slab::Slab;

use super::{Interest, ParkEvents};
use crate::stats::Counters;

const WAKE: Token = Token(usize::MAX);
/// Tokens at or above this are completion sources: `SOURCE_BASE + index`.
const SOURCE_BASE: usize = 1 << 48;

/// Wakers kept on one direction of one fd: past this many, they are woken
/// and dropped (see [`Poller::wait`]), so an fd that stays idle while task
/// after task waits on it and gives up holds a bounded list.
const WAITERS_KEPT: usize = 1024;

struct IoSlot {
    fd: RawFd,
    readers: Vec<Waker>,
    writers: Vec<Waker>,
}

/// An epoll instance and the fds registered with it.
pub(crate) struct Poller {
    poll: Poll,
    mio_events: Events,
    /// Each registered fd's slot in `io`, indexed by the fd itself: the
    /// kernel hands out the lowest free numbers, so this stays as long as
    /// the highest fd open, and finding an fd's waiters hashes nothing
    /// (every op that would block looks it up).
    fds: Vec<Option<usize>>,
    io: Slab<IoSlot>,
    /// fds of completion sources, by source token.
    sources: HashMap<u64, RawFd>,
    pub(crate) events: ParkEvents,
    /// The process it was made in: a forked child's copy of the epoll
    /// instance is the parent's, whose interest list it never changes.
    lineage: crate::fork::Lineage,
}

impl Poller {
    pub(crate) fn new(wake_fd: RawFd) -> io::Result<Poller> {
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut SourceFd(&wake_fd), WAKE, MioInterest::READABLE)?;
        Ok(Poller {
            poll,
            mio_events: Events::with_capacity(1024),
            fds: Vec::new(),
            io: Slab::new(),
            sources: HashMap::new(),
            events: ParkEvents::default(),
            lineage: crate::fork::Lineage::here(),
        })
    }

    /// Ops waiting for readiness.
    pub(crate) fn waiting(&self) -> usize {
        self.io
            .iter()
            .map(|(_, s)| s.readers.len() + s.writers.len())
            .sum()
    }

    /// Leaves `waker` on `fd` until the fd is ready for `interest`.
    pub(crate) fn wait(&mut self, fd: RawFd, interest: Interest, waker: &Waker) -> io::Result<()> {
        if self.lineage.forked() {
            return Err(super::iour::forked());
        }
        let at = usize::try_from(fd)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a negative fd"))?;
        let key = match self.fds.get(at).copied().flatten() {
            Some(k) => k,
            None => {
                let entry = self.io.vacant_entry();
                let key = entry.key();
                self.poll.registry().register(
                    &mut SourceFd(&fd),
                    Token(key),
                    MioInterest::READABLE | MioInterest::WRITABLE,
                )?;
                entry.insert(IoSlot {
                    fd,
                    readers: Vec::new(),
                    writers: Vec::new(),
                });
                if self.fds.len() <= at {
                    self.fds.resize(at + 1, None);
                }
                self.fds[at] = Some(key);
                key
            }
        };
        let slot = &mut self.io[key];
        let lists = match interest {
            Interest::Read => [Some(&mut slot.readers), None],
            Interest::Write => [Some(&mut slot.writers), None],
            Interest::Either => [Some(&mut slot.readers), Some(&mut slot.writers)],
        };
        for list in lists.into_iter().flatten() {
            if list.iter().any(|w| w.will_wake(waker)) {
                continue;
            }
            if list.len() >= WAITERS_KEPT {
                // Mostly wakers of ops dropped while they waited (a task
                // that timed out): nothing takes them off but an edge,
                // which an idle fd never gets. All are woken (a live
                // waiter retries its syscall and waits again) and let go.
                let mut wakes = crate::executor::Wakes::default();
                list.drain(..).for_each(|w| wakes.wake(w));
                wakes.finish();
            }
            list.push(waker.clone());
        }
        Ok(())
    }

    /// Takes every waiter of every fd (the runtime shut down: their ops end
    /// at their next poll).
    pub(crate) fn take_waiters(&mut self) -> Vec<Waker> {
        self.io
            .iter_mut()
            .flat_map(|(_, s)| s.readers.drain(..).chain(s.writers.drain(..)))
            .collect()
    }

    /// Deregisters `fd` (its owner is about to close it); wakes its waiters.
    pub(crate) fn forget(&mut self, fd: RawFd) {
        if self.lineage.forked() {
            return;
        }
        let taken = usize::try_from(fd)
            .ok()
            .and_then(|at| self.fds.get_mut(at))
            .and_then(Option::take);
        if let Some(key) = taken {
            let slot = self.io.remove(key);
            let _ = self.poll.registry().deregister(&mut SourceFd(&slot.fd));
            let mut wakes = crate::executor::Wakes::default();
            for w in slot.readers.into_iter().chain(slot.writers) {
                wakes.wake(w);
            }
            wakes.finish();
        }
    }

    pub(crate) fn watch_source(&mut self, fd: RawFd, token: u64) -> io::Result<()> {
        if self.lineage.forked() {
            return Err(super::iour::forked());
        }
        if self.sources.contains_key(&token) {
            return Ok(());
        }
        self.poll.registry().register(
            &mut SourceFd(&fd),
            Token(SOURCE_BASE + token as usize),
            MioInterest::READABLE,
        )?;
        self.sources.insert(token, fd);
        Ok(())
    }

    pub(crate) fn unwatch_source(&mut self, fd: RawFd) {
        if self.lineage.forked() {
            return;
        }
        self.sources.retain(|_, f| *f != fd);
        let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
    }

    pub(crate) fn park(
        &mut self,
        timeout: Option<Duration>,
        counters: &Counters,
    ) -> io::Result<()> {
        if timeout != Some(Duration::ZERO) {
            Counters::bump(&counters.parks);
        }
        if self.lineage.forked() {
            return Err(super::iour::forked());
        }
        match self.poll.poll(&mut self.mio_events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e),
        }
        // (Edge-triggered: an event not handed on now never comes again.)
        let mut wakes = crate::executor::Wakes::default();
        for ev in self.mio_events.iter() {
            let Token(t) = ev.token();
            if ev.token() == WAKE {
                self.events.woken = true;
            } else if t >= SOURCE_BASE {
                self.events.sources_ready.push((t - SOURCE_BASE) as u64);
            } else if let Some(slot) = self.io.get_mut(t) {
                let err = ev.is_error();
                if ev.is_readable() || ev.is_read_closed() || err {
                    slot.readers.drain(..).for_each(|w| wakes.wake(w));
                }
                if ev.is_writable() || ev.is_write_closed() || err {
                    slot.writers.drain(..).for_each(|w| wakes.wake(w));
                }
            }
        }
        wakes.finish();
        Ok(())
    }
}
