//! Whether this process is a fork of the one that made something: a child
//! of `fork(2)` has none of its parent's threads (an engine's thread, a
//! runtime's helpers) and shares its parent's io_uring rings, so what the
//! parent started is not the child's to use — a call waiting on such a
//! thread waits for ever.
//!
//! A `pthread_atfork` child handler counts forks; a [`Lineage`] remembers
//! the count it was taken at. Reading it is one relaxed load (no `getpid`
//! system call on every use).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Forks this process is down from its first [`Lineage`]'s.
static FORKS: AtomicU64 = AtomicU64::new(0);
static COUNTING: Once = Once::new();

extern "C" fn forked() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Which process, of a line of forks, something was made in.
#[derive(Debug, Clone, Copy)]
pub struct Lineage(u64);

impl Lineage {
    /// This process.
    pub fn here() -> Lineage {
        COUNTING.call_once(|| {
            // Only a child handler, and it only increments an atomic, which
            // is async-signal-safe, as a child of a threaded parent needs.
            // SAFETY: registers that handler; no prepare or parent handler.
            let r = unsafe { libc::pthread_atfork(None, None, Some(forked)) };
            assert_eq!(r, 0, "pthread_atfork failed");
        });
        Lineage(FORKS.load(Ordering::Relaxed))
    }

    /// True in a child forked from the process this was taken in.
    #[inline]
    pub fn forked(&self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_knows_it_is_one_and_its_parent_does_not() {
        let here = Lineage::here();
        assert!(!here.forked());
        // SAFETY: the child only reads an atomic and exits with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = if here.forked() && !Lineage::here().forked() {
                0
            } else {
                1
            };
            // SAFETY: ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child this test forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(!here.forked());
    }
}
