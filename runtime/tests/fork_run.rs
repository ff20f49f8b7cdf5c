//! A runtime a forked child inherits cannot be run there: its ring (or
//! epoll instance) is the parent's, and an op the child started would be
//! submitted by the parent, in the parent's address space, under a token
//! the parent hands out next. (Its own binary: the child runs code after
//! the fork, so no other test's thread may hold a lock then.)

use std::os::fd::{FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};

use quiesce_runtime::fd::Fd;
use quiesce_runtime::Runtime;

fn socket_pair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: writes two fds into a live array of two, or returns -1.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) },
        0
    );
    // SAFETY: socketpair returned two new descriptors nothing else owns.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// The child's `block_on` panics before its future runs, so nothing of it
/// reaches the parent's ring; the parent's next ops complete as its own.
/// The child's read went into the shared submission queue before the
/// reactor's first turn noticed the fork, and the parent's next enter
/// submitted it.
#[test]
fn a_forked_child_cannot_run_its_parents_runtime() {
    let rt = Runtime::new().unwrap();
    let (a, b) = socket_pair();
    let (a, b) = rt.block_on(async { (Fd::new(a).unwrap(), Fd::new(b).unwrap()) });
    // SAFETY: the child only runs the runtime (which must refuse) and ends
    // with `_exit`; this binary runs one test.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let (c, _d) = socket_pair();
        let ran = catch_unwind(AssertUnwindSafe(|| {
            rt.block_on(async move {
                let c = Fd::new(c).unwrap();
                let _ = c.read(vec![0u8; 8]).await;
            })
        }));
        // SAFETY: ends the child at once; 0 if the runtime refused to run.
        unsafe { libc::_exit(i32::from(ran.is_ok())) };
    }
    let mut status = 0;
    // SAFETY: waits for the child this test forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child ran its parent's runtime ({status:#x})"
    );
    rt.block_on(async {
        for round in 0..4u8 {
            let (w, _) = b.write(vec![round]).await;
            assert_eq!(
                w.map_err(|e| e.raw_os_error()),
                Ok(1),
                "round {round}: write"
            );
            let (r, buf) = a.read(vec![0u8; 8]).await;
            assert_eq!(
                r.map_err(|e| e.raw_os_error()),
                Ok(1),
                "round {round}: read"
            );
            assert_eq!(buf[0], round);
        }
    });
}
