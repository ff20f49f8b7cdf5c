//! A transfer that panics: the batch has lost track of a buffer and gives no
//! outcome, only the panic, to whoever awaits it — once. The driver the
//! panic went through is finished: it is not set running again as a task
//! of its own when the `Submitted` that polled it is dropped, where its
//! next poll would panic a second time ("`async fn` resumed after
//! panicking").

use std::cell::RefCell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quiesce_batch::{Batch, BatchOptions, Transport};
use quiesce_runtime::{time::sleep, yield_now, IoBuf, IoBufMut, Runtime};
use quiesce_transports::TransferError;

/// A transport whose transfers panic. Each target is a 64-byte range and
/// its own peer.
#[derive(Clone, Copy)]
enum Panicky {
    /// Every transfer waits one turn of the reactor, then panics.
    AfterATurn,
    /// Target 0 refuses at once; the others ignore the abort, end 100 ms
    /// later and then panic.
    Late,
    /// Every transfer waits one turn; then target 0 refuses, and the others
    /// panic at their fourth poll, which comes in the same poll of the
    /// driver as target 0's refusal.
    FourthPoll,
}

async fn panics<B>(how: Panicky, target: u64, buf: B) -> (Result<u64, TransferError>, B) {
    match how {
        Panicky::AfterATurn => yield_now().await,
        Panicky::Late if target == 0 => return (Err(TransferError::Forbidden(0)), buf),
        Panicky::Late => sleep(Duration::from_millis(100)).await,
        Panicky::FourthPoll => {
            yield_now().await;
            if target == 0 {
                return (Err(TransferError::Forbidden(0)), buf);
            }
            yield_now().await;
            yield_now().await;
        }
    }
    if std::hint::black_box(true) {
        match how {
            Panicky::AfterATurn => panic!("a transfer that panics"),
            Panicky::Late => panic!("a transfer that panics late"),
            Panicky::FourthPoll => panic!("a transfer that panics at its fourth poll"),
        }
    }
    (Ok(0), buf)
}

impl Transport for Panicky {
    type Target = u64;
    type Peer = u64;

    fn peer(&self, target: &u64) -> u64 {
        *target
    }

    fn len(&self, _: &u64) -> u64 {
        64
    }

    fn write<B: IoBuf>(
        &self,
        target: &u64,
        src: B,
        _: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        panics(*self, *target, src)
    }

    fn read<B: IoBufMut>(
        &self,
        target: &u64,
        dst: B,
        _: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        panics(*self, *target, dst)
    }

    fn fence(&self, _: &u64, _: u64) -> impl Future<Output = Result<(), TransferError>> + 'static {
        std::future::ready(Ok(()))
    }

    fn abort(&self, _: &u64) {}
}

thread_local! {
    /// The messages of the panics of this thread, while recorded.
    static PANICS: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
}

/// The panic messages of this thread while `f` runs (panics of other
/// threads go to the hook as before).
fn panics_during(f: impl FnOnce()) -> Vec<String> {
    static HOOK: Mutex<()> = Mutex::new(());
    let _one = HOOK.lock().unwrap_or_else(|e| e.into_inner());
    let before = Arc::new(std::panic::take_hook());
    let rest = before.clone();
    std::panic::set_hook(Box::new(move |info| {
        let mine = PANICS.with(|p| {
            p.borrow_mut().as_mut().map(|v| {
                let msg = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                v.push(msg);
            })
        });
        if mine.is_none() {
            rest(info);
        }
    }));
    PANICS.with(|p| *p.borrow_mut() = Some(Vec::new()));
    let ran = catch_unwind(AssertUnwindSafe(f));
    let seen = PANICS.with(|p| p.borrow_mut().take()).unwrap_or_default();
    drop(std::panic::take_hook());
    std::panic::set_hook(Box::new(move |info| before(info)));
    if let Err(panic) = ran {
        // The test's own assertion failed in `f`: its message was recorded.
        eprintln!("panics while recording: {seen:?}");
        std::panic::resume_unwind(panic);
    }
    seen
}

#[test]
fn a_transfer_that_panics_panics_the_batch_once() {
    // One task (held in the driver's state), three (polled in place) and
    // twenty (each a task of its own, whose panic the driver re-raises).
    for tasks in [1usize, 3, 20] {
        let rt = Runtime::new().unwrap();
        let seen = panics_during(|| {
            let awaited = catch_unwind(AssertUnwindSafe(|| {
                rt.block_on(async {
                    let mut batch = Batch::new(Panicky::AfterATurn, BatchOptions::default());
                    for _ in 0..tasks {
                        batch.write(vec![7u8; 64], 64).ok().unwrap();
                    }
                    batch.submit().await
                })
            }));
            assert!(
                awaited.is_err(),
                "{tasks} task(s): the batch gave an outcome"
            );
            // Whatever the panic left behind runs now.
            rt.block_on(async {
                for _ in 0..10 {
                    yield_now().await;
                }
                sleep(Duration::from_millis(20)).await;
            });
        });
        assert!(
            seen.iter().all(|m| m == "a transfer that panics"),
            "{tasks} task(s): a second panic after the transfer's: {seen:?}"
        );
        // Each transfer that ran panicked (a spawned one whatever the
        // others did), and nothing else did.
        assert!(!seen.is_empty() && seen.len() <= tasks, "{tasks}: {seen:?}");
    }
}

/// Fail-fast, 10 ms of grace: target 0 refuses its write at once, and the
/// fence cannot end target 1's (it ignores the abort), which panics 100 ms
/// later — after the batch's completion became unknown.
fn refused_and_late() -> Batch<Panicky, Vec<u8>> {
    let opts = BatchOptions {
        fence_grace: Duration::from_millis(10),
        policy: quiesce_batch::FailurePolicy::FailFast,
        ..BatchOptions::default()
    };
    let mut batch = Batch::new(Panicky::Late, opts);
    batch.write(vec![1u8; 64], 0).ok().unwrap();
    batch.write(vec![2u8; 64], 1).ok().unwrap();
    batch
}

/// A batch whose completion became unknown goes on as a task of its own;
/// when a transfer panics there, the ticket's wait raises that panic, once,
/// rather than waiting for a result that can never come.
#[test]
fn a_ticket_raises_the_panic_of_its_detached_batch() {
    use quiesce_batch::Outcome;
    let rt = Runtime::new().unwrap();
    let seen = panics_during(|| {
        let ticket = rt.block_on(async {
            let batch = refused_and_late();
            match batch.submit().await {
                Outcome::CompletionUnknown(t) => t,
                Outcome::Quiesced(q) => panic!("quiesced: {:?}", q.tasks()),
            }
        });
        let waited = catch_unwind(AssertUnwindSafe(|| {
            rt.block_on(ticket.wait_for(Duration::from_secs(2)))
        }));
        match waited {
            Err(_) => {}
            Ok(Ok(_)) => panic!("the ticket gave the buffers of a panicked batch back"),
            Ok(Err(_)) => panic!("the ticket still waits 2 s after its batch panicked"),
        }
    });
    assert_eq!(seen, ["a transfer that panics late"], "{seen:?}");
}

/// A `Submitted` polled again after it resolved to `CompletionUnknown`
/// panics: it handed out a second ticket (whose drop abandoned the batch,
/// so the first never resolved), or, once the batch drained, the result
/// itself (and the ticket then waited for ever).
#[test]
fn a_submitted_polled_after_it_resolved_panics() {
    use quiesce_batch::Outcome;
    use std::task::Poll;
    let rt = Runtime::new().unwrap();
    let seen = panics_during(|| {
        rt.block_on(async {
            let batch = refused_and_late();
            let mut submitted = std::pin::pin!(batch.submit());
            let first = std::future::poll_fn(|cx| submitted.as_mut().poll(cx)).await;
            assert!(matches!(first, Outcome::CompletionUnknown(_)));
            let again = catch_unwind(AssertUnwindSafe(|| {
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                submitted.as_mut().poll(&mut cx)
            }));
            assert!(
                !matches!(again, Ok(Poll::Ready(_))),
                "a resolved Submitted gave a second outcome"
            );
            drop(first);
            // Let the detached batch end (its transfer panics late).
            sleep(Duration::from_millis(150)).await;
        });
    });
    assert!(
        seen.contains(&"`Submitted` polled after it resolved".to_string()),
        "{seen:?}"
    );
}

/// A `Submitted` polled again after it passed on a transfer's panic panics
/// too. In one poll of the driver, target 0's refusal fenced the batch
/// with no grace, and then target 1's transfer panicked: a second poll
/// waited for good (its driver was gone with the panic) — or, had the
/// fence's grace run out in that poll, handed out a `CompletionUnknown`
/// whose ticket could never resolve.
#[test]
fn a_submitted_polled_again_after_a_panic_panics() {
    use quiesce_batch::Outcome;
    use std::task::Poll;
    let rt = Runtime::new().unwrap();
    let seen = panics_during(|| {
        rt.block_on(async {
            let opts = BatchOptions {
                fence_grace: Duration::ZERO,
                policy: quiesce_batch::FailurePolicy::FailFast,
                ..BatchOptions::default()
            };
            let mut batch = Batch::new(Panicky::FourthPoll, opts);
            batch.write(vec![1u8; 64], 0).ok().unwrap();
            batch.write(vec![2u8; 64], 1).ok().unwrap();
            let mut submitted = std::pin::pin!(batch.submit());
            yield_now().await;
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let first = catch_unwind(AssertUnwindSafe(|| submitted.as_mut().poll(&mut cx)));
            assert!(first.is_err(), "the transfer's panic was not passed on");
            let again = catch_unwind(AssertUnwindSafe(|| submitted.as_mut().poll(&mut cx)));
            if let Ok(Poll::Ready(Outcome::CompletionUnknown(t))) = again {
                let waited = t.wait_for(Duration::from_millis(500)).await;
                panic!(
                    "polled again after the panic: a ticket (waited 500 ms: {:?})",
                    waited.map(|_| ())
                );
            }
            match again {
                Err(_) => {}
                Ok(Poll::Pending) => panic!("polled again after the panic: pending (for good)"),
                Ok(Poll::Ready(_)) => panic!("polled again after the panic: an outcome"),
            }
        });
    });
    assert!(
        seen.contains(&"a transfer that panics at its fourth poll".to_string()),
        "{seen:?}"
    );
}
