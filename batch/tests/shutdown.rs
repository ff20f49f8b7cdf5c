//! A batch still in flight when its runtime is dropped: its driver is
//! dropped with the runtime's tasks (the transfers' ops parked and drained),
//! never forgotten — nothing leaks, nothing is freed early.

use std::cell::Cell;
use std::rc::Rc;

use quiesce_batch::sim::{Sim, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions};
use quiesce_runtime::{yield_now, IoBuf, IoBufMut, Runtime};

/// A buffer that records when it is dropped.
struct Flagged {
    data: Vec<u8>,
    dropped: Rc<Cell<bool>>,
}

impl Drop for Flagged {
    fn drop(&mut self) {
        self.dropped.set(true);
    }
}

// SAFETY: delegates to the Vec, whose heap storage never moves.
unsafe impl IoBuf for Flagged {
    fn stable_ptr(&self) -> *const u8 {
        self.data.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.data.len()
    }
    fn bytes_total(&self) -> usize {
        self.data.len()
    }
}

// SAFETY: as above; the Vec is fully initialised.
unsafe impl IoBufMut for Flagged {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.data.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

#[test]
fn a_batch_in_flight_when_its_runtime_drops_is_dropped_not_leaked() {
    let rt = Runtime::new().unwrap();
    let dropped = Rc::new(Cell::new(false));
    let cfg = SimConfig {
        max_turns: 1000,
        retryable_fail: 0,
        refused: 0,
        stuck_fence: 100,
        ..SimConfig::default()
    };
    let buf = Flagged {
        data: vec![0; 64],
        dropped: dropped.clone(),
    };
    rt.block_on(async {
        let mut batch = Batch::new(Sim::new(1, cfg), BatchOptions::default());
        batch
            .write(buf, SimTarget { peer: 0, len: 64 })
            .ok()
            .unwrap();
        let sub = batch.submit();
        quiesce_runtime::spawn_local(async move {
            let _ = sub.await;
        });
        yield_now().await;
    });
    assert!(!dropped.get(), "the transfer is still in flight");
    drop(rt);
    assert!(
        dropped.get(),
        "the in-flight batch was leaked with its runtime"
    );
}
