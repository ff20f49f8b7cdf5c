//! Helpers shared by the runtime's integration tests.
#![allow(dead_code)]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quiesce_runtime::net::{TcpListener, TcpStream};
use quiesce_runtime::{try_stats, DriverKind, IoBuf, IoBufMut, Runtime, Stats};

/// A runtime on the driver chosen by `QUIESCE_DRIVER` (auto when unset).
pub fn rt() -> Runtime {
    Runtime::new().expect("runtime")
}

pub fn is_uring(rt: &Runtime) -> bool {
    rt.driver_kind() == DriverKind::IoUring
}

/// What a [`Tracked`] buffer saw at the moment it was dropped.
#[derive(Default, Debug)]
pub struct DropLog {
    pub dropped: bool,
    /// The runtime's counters at the moment of the drop.
    pub stats_at_drop: Option<Stats>,
}

pub type Log = Rc<RefCell<DropLog>>;

/// A heap buffer whose `Drop` records the moment it was released.
pub struct Tracked {
    buf: Vec<u8>,
    on_drop: Box<dyn FnMut(Option<Stats>)>,
}

impl Tracked {
    pub fn new(len: usize, fill: u8) -> (Tracked, Log) {
        let log = Log::default();
        let l = log.clone();
        let on_drop = move |stats: Option<Stats>| {
            let mut l = l.borrow_mut();
            assert!(!l.dropped, "buffer dropped twice");
            l.dropped = true;
            l.stats_at_drop = stats;
        };
        (
            Tracked {
                buf: vec![fill; len],
                on_drop: Box::new(on_drop),
            },
            log,
        )
    }

    /// A buffer that pushes the runtime's counters at its drop into `out`,
    /// from whichever thread drops it.
    pub fn reporting(len: usize, out: Arc<Mutex<Vec<Option<Stats>>>>) -> Tracked {
        Tracked {
            buf: vec![0; len],
            on_drop: Box::new(move |s| out.lock().unwrap().push(s)),
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        (self.on_drop)(try_stats());
    }
}

// SAFETY: delegates to the inner Vec, whose heap storage never moves.
unsafe impl IoBuf for Tracked {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.buf.len()
    }
    fn bytes_total(&self) -> usize {
        self.buf.len()
    }
}

// SAFETY: as above; the Vec is fully initialised.
unsafe impl IoBufMut for Tracked {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// A connected pair of streams over loopback.
pub async fn pair() -> (TcpStream, Rc<TcpStream>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let connect =
        quiesce_runtime::spawn_local(async move { TcpStream::connect(addr).await.unwrap() });
    let (server, _) = l.accept().await.unwrap();
    let client = connect.await.unwrap();
    (client, Rc::new(server))
}

/// Lets the reactor turn a few times.
pub async fn settle() {
    quiesce_runtime::time::sleep(Duration::from_millis(20)).await;
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Polls `fut` once, with a no-op waker.
pub fn poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::Pin::new(fut).poll(&mut cx)
}

/// A connected loopback pair of std sockets: (client, server).
pub fn loopback_pair() -> (std::net::TcpStream, std::net::TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, _) = l.accept().unwrap();
    (client, server)
}

/// A waker that panics when woken (cloning and dropping it work).
pub fn waker_that_panics_when_woken() -> std::task::Waker {
    use std::task::{RawWaker, RawWakerVTable, Waker};
    fn clone(p: *const ()) -> RawWaker {
        RawWaker::new(p, &VTABLE)
    }
    fn wake(_: *const ()) {
        panic!("a waker that panics when woken")
    }
    fn ignore(_: *const ()) {}
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, wake, wake, ignore);
    // SAFETY: every function of the vtable ignores the (null) data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

/// What [`PanicsOnDrop`] panics with.
pub const PANICS_ON_DROP: &str = "a future that panics when dropped";

/// Ready at once (or never, `pending`), and panics when dropped.
pub struct PanicsOnDrop {
    pub pending: bool,
}

impl std::future::Future for PanicsOnDrop {
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match self.pending {
            true => std::task::Poll::Pending,
            false => std::task::Poll::Ready(()),
        }
    }
}

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        std::panic::panic_any(PANICS_ON_DROP);
    }
}
