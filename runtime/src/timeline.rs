//! Where a small transfer's latency goes: clock readings at fixed steps of
//! its life, on both sides of a connection, for
//! `scripts/latency-breakdown.sh` to line up (docs/BENCHMARKS.md, "Where a
//! 4 KiB call's time goes").
//!
//! Without the `timeline` feature [`mark`] is an empty inline function: a
//! release build records nothing and pays nothing. With it, a thread
//! records a step only when `QUIESCE_TIMELINE` names a directory: the
//! first `QUIESCE_TIMELINE_EVENTS` readings (default 150,000) of each
//! thread are kept in memory and then written once, as
//! `<dir>/<pid>.<n>` (the process's `n`-th recording thread), one
//! `step nanoseconds` line each. The clock is `CLOCK_MONOTONIC`, the same
//! for every process of the host, so an initiator's and a target's files
//! line up.

/// A step of a transfer that [`mark`] records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Step {
    /// A blocking call from Python entered the binding.
    CallEntered = 1,
    /// A frame's `sendmsg(2)` is about to be made.
    SendStarted = 2,
    /// That `sendmsg(2)` returned.
    SendReturned = 3,
    /// A receive that got bytes returned (polled or through the ring).
    Received = 4,
    /// The blocking call is about to return to Python (the GIL taken).
    CallReturned = 5,
    /// A polling reader is about to try a non-blocking `recv(2)`.
    PollStarted = 8,
}

/// Records `step` with the time now (see the module's text); nothing
/// without the `timeline` feature.
#[cfg(not(feature = "timeline"))]
#[inline(always)]
pub fn mark(step: Step) {
    let _ = step;
}

/// Records `step` with the time now (see the module's text); nothing
/// without the `timeline` feature.
#[cfg(feature = "timeline")]
pub fn mark(step: Step) {
    recording::mark(step)
}

#[cfg(feature = "timeline")]
mod recording {
    use std::cell::RefCell;
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;

    use super::Step;

    /// Where to write and how many readings a thread keeps.
    struct Setting {
        dir: PathBuf,
        events: usize,
    }

    fn setting() -> Option<&'static Setting> {
        static SETTING: OnceLock<Option<Setting>> = OnceLock::new();
        SETTING
            .get_or_init(|| {
                let dir = PathBuf::from(std::env::var_os("QUIESCE_TIMELINE")?);
                let events = std::env::var("QUIESCE_TIMELINE_EVENTS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(150_000);
                Some(Setting { dir, events })
            })
            .as_ref()
    }

    /// A thread's readings; `written` once its file exists.
    struct Readings {
        steps: Vec<(u8, u64)>,
        written: bool,
    }

    thread_local! {
        static READINGS: RefCell<Readings> = const {
            RefCell::new(Readings { steps: Vec::new(), written: false })
        };
    }

    static THREADS: AtomicUsize = AtomicUsize::new(0);

    fn monotonic_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec and CLOCK_MONOTONIC
        // always exists on Linux.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    pub(super) fn mark(step: Step) {
        let Some(s) = setting() else { return };
        let t = monotonic_ns();
        let _ = READINGS.try_with(|r| {
            let mut r = r.borrow_mut();
            if r.written {
                return;
            }
            if r.steps.capacity() == 0 {
                r.steps.reserve_exact(s.events);
            }
            r.steps.push((step as u8, t));
            if r.steps.len() >= s.events {
                r.written = true;
                let n = THREADS.fetch_add(1, Ordering::Relaxed);
                let path = s.dir.join(format!("{}.{n}", std::process::id()));
                let mut out = String::with_capacity(r.steps.len() * 24);
                for (k, t) in &r.steps {
                    out.push_str(&format!("{k} {t}\n"));
                }
                r.steps = Vec::new();
                if let Err(e) =
                    std::fs::File::create(&path).and_then(|mut f| f.write_all(out.as_bytes()))
                {
                    tracing::warn!(path = %path.display(), error = %e, "timeline not written");
                }
            }
        });
    }
}

#[cfg(all(test, feature = "timeline"))]
mod tests {
    use super::{mark, Step};

    /// A recording thread writes its first `QUIESCE_TIMELINE_EVENTS`
    /// readings, in order and with a clock that does not go back, and
    /// nothing after them.
    #[test]
    fn a_thread_writes_its_first_readings_once() {
        let dir = std::env::temp_dir().join(format!("quiesce-timeline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // SAFETY: the only test of this binary that reads these variables,
        // set before its first `mark` and never changed.
        unsafe {
            std::env::set_var("QUIESCE_TIMELINE", &dir);
            std::env::set_var("QUIESCE_TIMELINE_EVENTS", "3");
        }
        std::thread::spawn(|| {
            for step in [
                Step::SendStarted,
                Step::SendReturned,
                Step::Received,
                Step::CallReturned,
            ] {
                mark(step);
            }
        })
        .join()
        .unwrap();
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(
            files.len(),
            1,
            "one file for the one recording thread: {files:?}"
        );
        let text = std::fs::read_to_string(&files[0]).unwrap();
        let lines: Vec<(u8, u64)> = text
            .lines()
            .map(|l| {
                let (k, t) = l.split_once(' ').unwrap();
                (k.parse().unwrap(), t.parse().unwrap())
            })
            .collect();
        assert_eq!(
            lines.iter().map(|l| l.0).collect::<Vec<_>>(),
            [
                Step::SendStarted as u8,
                Step::SendReturned as u8,
                Step::Received as u8
            ]
        );
        assert!(lines.windows(2).all(|w| w[0].1 <= w[1].1), "{lines:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
