//! Where a transfer's time goes: clock readings at fixed steps of its life,
//! on both sides of a connection, for `scripts/latency-breakdown.sh` (a
//! small call's latency) and `scripts/fail-fast-breakdown.sh` (a failed
//! batch's way to its outcome) to line up (docs/BENCHMARKS.md).
//!
//! Without the `timeline` feature [`mark`] is an empty inline function: a
//! release build records nothing and pays nothing. With it, a thread
//! records a step only when `QUIESCE_TIMELINE` names a directory: the
//! first `QUIESCE_TIMELINE_EVENTS` readings (default 150,000) of each
//! thread are kept in memory and written once — when there are that many,
//! or when the thread exits with fewer — as `<dir>/<pid>.<n>` (the
//! process's `n`-th thread to write), followed by `.<name>` for a named
//! thread, one `step nanoseconds` line each. The clock is
//! `CLOCK_MONOTONIC`, the same for every process of the host, so an
//! initiator's and a target's files line up.

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
    /// A batch driver launched an attempt's transfers.
    BatchLaunched = 9,
    /// A target sent a refusal (a request's status other than `Ok`).
    RefusalSent = 10,
    /// An initiator read a refusal.
    RefusalRead = 11,
    /// A batch driver started fencing its batch.
    FenceStarted = 12,
    /// A target read a `Fence`.
    FenceReceived = 13,
    /// That target's landing receives of the batch are reaped: it acks next.
    FenceQuiet = 14,
    /// An initiator read a `FenceAck`.
    FenceAckRead = 15,
    /// Every task of a batch driver's attempt is terminal.
    BatchQuiesced = 16,
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
        /// The thread's name, taken at its first reading (at its exit the
        /// thread's own data may be gone).
        name: Option<String>,
    }

    thread_local! {
        static READINGS: RefCell<Readings> = const {
            RefCell::new(Readings { steps: Vec::new(), written: false, name: None })
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
                r.name = std::thread::current().name().map(str::to_owned);
            }
            r.steps.push((step as u8, t));
            if r.steps.len() >= s.events {
                r.write(s);
            }
        });
    }

    impl Readings {
        /// Writes the readings to the thread's file, once.
        fn write(&mut self, s: &Setting) {
            self.written = true;
            let n = THREADS.fetch_add(1, Ordering::Relaxed);
            let mut file = format!("{}.{n}", std::process::id());
            if let Some(name) = &self.name {
                // A name is any string: no separator may leave the directory.
                file.push('.');
                file.extend(name.chars().map(|c| if c == '/' { '_' } else { c }));
            }
            let path = s.dir.join(file);
            let mut out = String::with_capacity(self.steps.len() * 24);
            for (k, t) in &self.steps {
                out.push_str(&format!("{k} {t}\n"));
            }
            self.steps = Vec::new();
            if let Err(e) =
                std::fs::File::create(&path).and_then(|mut f| f.write_all(out.as_bytes()))
            {
                // Not `tracing`, nor `eprintln!` (which panics if stderr
                // fails): at the thread's exit its dispatcher may be gone,
                // and a panic in a thread-local's destructor aborts.
                let _ = writeln!(
                    std::io::stderr(),
                    "quiesce: timeline {} not written: {e}",
                    path.display()
                );
            }
        }
    }

    /// A thread that exits with fewer readings than the limit writes them
    /// then.
    impl Drop for Readings {
        fn drop(&mut self) {
            if self.written || self.steps.is_empty() {
                return;
            }
            if let Some(s) = setting() {
                self.write(s);
            }
        }
    }
}

#[cfg(all(test, feature = "timeline"))]
mod tests {
    use super::{mark, Step};

    fn read(path: &std::path::Path) -> Vec<(u8, u64)> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                let (k, t) = l.split_once(' ').unwrap();
                (k.parse().unwrap(), t.parse().unwrap())
            })
            .collect()
    }

    /// A recording thread writes its first `QUIESCE_TIMELINE_EVENTS`
    /// readings, in order and with a clock that does not go back, and
    /// nothing after them; a thread that exits with fewer writes those at
    /// its exit, its name in its file's.
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
        let lines = read(&files[0]);
        assert_eq!(
            lines.iter().map(|l| l.0).collect::<Vec<_>>(),
            [
                Step::SendStarted as u8,
                Step::SendReturned as u8,
                Step::Received as u8
            ]
        );
        assert!(lines.windows(2).all(|w| w[0].1 <= w[1].1), "{lines:?}");
        // Fewer than the limit: written when the thread exits.
        std::thread::Builder::new()
            .name("short".into())
            .spawn(|| {
                mark(Step::FenceStarted);
                mark(Step::BatchQuiesced);
            })
            .unwrap()
            .join()
            .unwrap();
        let short: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| !files.contains(p))
            .collect();
        assert_eq!(short.len(), 1, "the exited thread's file: {short:?}");
        let name = short[0].file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.ends_with(".short"), "named after its thread: {name}");
        assert_eq!(
            read(&short[0]).iter().map(|l| l.0).collect::<Vec<_>>(),
            [Step::FenceStarted as u8, Step::BatchQuiesced as u8]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
