// A buffer moved into a batch cannot be touched while the batch owns it.
use quiesce_batch::sim::{Sim, SimBuf, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions};

fn main() {
    let mut batch = Batch::new(Sim::new(1, SimConfig::default()), BatchOptions::default());
    let buf = SimBuf::new(0, 4096);
    batch.write(buf, SimTarget { peer: 0, len: 4096 }).ok();
    let _in_flight = batch.submit();
    println!("{}", buf.id);
}
