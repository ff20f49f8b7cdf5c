// A submitted batch is gone: no task can be added to it, nothing taken out.
use quiesce_batch::sim::{Sim, SimBuf, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions};

fn main() {
    let mut batch = Batch::new(Sim::new(1, SimConfig::default()), BatchOptions::default());
    batch.write(SimBuf::new(0, 8), SimTarget { peer: 0, len: 8 }).ok();
    let _in_flight = batch.submit();
    batch.write(SimBuf::new(1, 8), SimTarget { peer: 0, len: 8 }).ok();
}
