// The only way to hold a batch's buffers again is a `Quiesced` that the
// batch produced; one cannot be assembled by hand.
use quiesce_batch::sim::SimBuf;
use quiesce_batch::Quiesced;

fn forge() -> Quiesced<SimBuf> {
    Quiesced { tasks: Default::default(), buffers: Default::default(), fence_ns: 0, elapsed_ns: 0 }
}

fn main() {
    let _ = forge;
}
