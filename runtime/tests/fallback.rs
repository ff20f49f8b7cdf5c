//! How a runtime is built: `DriverKind::Auto` falls back to epoll when io_uring is
//! blocked, and says why; sizes past what the kernel takes are clamped.

use quiesce_runtime::{BuildError, DriverKind, Runtime};

/// Installs, on the calling thread only, a seccomp filter that makes
/// `io_uring_setup` fail with `EPERM` — what container runtimes do.
fn block_io_uring_on_this_thread() {
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    const NR_IO_URING_SETUP: u32 = 425;
    // Load the syscall number (offset 0 of seccomp_data); if it is
    // io_uring_setup return EPERM, else allow.
    let filter = [
        libc::sock_filter {
            code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: NR_IO_URING_SETUP,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: SECCOMP_RET_ALLOW,
        },
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut _,
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) },
        0
    );
    // SAFETY: `prog` points to a valid filter that outlives the call (the kernel copies it).
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &prog as *const _,
            0,
            0,
        )
    };
    assert_eq!(rc, 0, "seccomp: {}", std::io::Error::last_os_error());
}

#[test]
fn auto_falls_back_to_epoll_when_seccomp_blocks_io_uring() {
    std::thread::spawn(|| {
        block_io_uring_on_this_thread();
        let rt = Runtime::builder()
            .driver(DriverKind::Auto)
            .build()
            .expect("auto must fall back");
        assert_eq!(rt.driver_kind(), DriverKind::Epoll);
        assert_eq!(rt.block_on(async { 1 + 1 }), 2);
        match Runtime::builder().driver(DriverKind::IoUring).build() {
            Err(BuildError::IoUringUnavailable { reason, source }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EPERM));
                assert!(
                    reason.contains("seccomp"),
                    "reason should name the cause: {reason}"
                );
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("io_uring must be refused"),
        }
    })
    .join()
    .unwrap();
}

#[test]
fn a_bad_quiesce_driver_value_is_a_typed_error() {
    // The other test in this binary forces its drivers, so it never reads
    // QUIESCE_DRIVER while this one changes it; the value is restored after.
    let old = std::env::var("QUIESCE_DRIVER").ok();
    std::env::set_var("QUIESCE_DRIVER", "kqueue");
    let r = Runtime::builder().build();
    match old {
        Some(v) => std::env::set_var("QUIESCE_DRIVER", v),
        None => std::env::remove_var("QUIESCE_DRIVER"),
    }
    match r {
        Err(BuildError::BadDriverEnv(v)) => assert_eq!(v, "kqueue"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("must refuse"),
    }
}

/// `entries(u32::MAX)`: the kernel clamps the ring (`setup_clamp`), and so
/// must the driver's table of ops, sized from it. It was sized from the
/// number asked for (4.3 billion slots, ~170 GB): the allocation failed and
/// the process aborted. Run in a child process, which an abort kills. (A
/// kernel that refuses so large a ring — one charging it to
/// `RLIMIT_MEMLOCK`, or no io_uring at all — answers a typed error: no
/// abort either.)
#[test]
fn a_ring_size_past_the_kernels_is_clamped_not_an_abort() {
    const CHILD: &str = "QUIESCE_TEST_HUGE_RING_CHILD";
    if std::env::var_os(CHILD).is_some() {
        match Runtime::builder()
            .driver(DriverKind::IoUring)
            .entries(u32::MAX)
            .build()
        {
            Ok(rt) => rt.block_on(quiesce_runtime::yield_now()),
            Err(e) => eprintln!("no ring here: {e}"),
        }
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_ring_size_past_the_kernels_is_clamped_not_an_abort",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the child died: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
