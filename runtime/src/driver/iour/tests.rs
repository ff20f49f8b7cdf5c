use super::{enter_failed, EnterFailed};

/// Out of memory or resources the kernel asks for a retry once some
/// completions are reaped: the reactor must not die of it.
#[test]
fn out_of_resources_is_retried_and_a_broken_ring_is_not() {
    for errno in [libc::EBUSY, libc::EAGAIN, libc::ENOMEM] {
        assert_eq!(
            enter_failed(Some(errno)),
            EnterFailed::Retry,
            "errno {errno}"
        );
    }
    for errno in [libc::EINTR, libc::ETIME] {
        assert_eq!(
            enter_failed(Some(errno)),
            EnterFailed::Submitted,
            "errno {errno}"
        );
    }
    for errno in [libc::EBADF, libc::EFAULT, libc::EEXIST, libc::EOWNERDEAD] {
        assert_eq!(
            enter_failed(Some(errno)),
            EnterFailed::Fatal,
            "errno {errno}"
        );
    }
    assert_eq!(enter_failed(None), EnterFailed::Fatal);
}
