//! A forked child's copy of a runtime: its io_uring rings (or epoll
//! instance) are the parent's own kernel objects, so nothing the child does
//! with them may reach the parent's operations.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use quiesce_runtime::fd::Fd;
use quiesce_runtime::{spawn_local, time, Runtime};

/// A parent's read is in the kernel when it forks; the child drops its copy
/// of the runtime (as a runtime in a thread-local is at `exit`) and exits.
/// The parent's read must still complete with the byte written after. The
/// child's drop cancelled the task's op through the shared ring (the
/// parent's read ended `ECANCELED`) and drained the shared completion
/// queue (the parent's completions gone with it).
#[test]
fn a_forked_child_dropping_its_runtime_leaves_the_parents_ops_alone() {
    let mut fds = [0; 2];
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: writes two fds into a live array of two, or returns -1.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) },
        0
    );
    // SAFETY: socketpair returned two new descriptors nothing else owns.
    let (a, b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let rt = Runtime::new().unwrap();
    // The read's task, carried out of this `block_on` to be awaited later.
    #[allow(clippy::async_yields_async)]
    let read = rt.block_on(async move {
        let a = Fd::new(a).unwrap();
        let t = spawn_local(async move {
            let (r, buf) = a.read(vec![0u8; 1]).await;
            (r.map_err(|e| e.raw_os_error()), buf)
        });
        // A turn that parks submits the read.
        time::sleep(Duration::from_millis(20)).await;
        t
    });
    // SAFETY: the child only drops the runtime and ends with `_exit`; this
    // binary runs one test, so no other thread of the harness allocates.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        drop(rt);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child this test forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    // Through the runtime: an entry the child left in the shared
    // submission queue goes to the kernel with the parent's next.
    let out = rt.block_on(async move {
        let b = Fd::new(b).unwrap();
        let (w, _) = b.write(vec![7u8]).await;
        assert_eq!(w.unwrap(), 1);
        time::timeout(Duration::from_secs(2), read).await
    });
    let (r, buf) = out
        .expect("the parent's read never completed: the child reaped it")
        .expect("the read's task");
    assert_eq!(r, Ok(1), "the parent's read");
    assert_eq!(buf[0], 7);
}
