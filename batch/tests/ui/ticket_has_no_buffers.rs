// A ticket (completion unknown) never hands out buffers before quiescence:
// it has no accessor for them; only `wait` (or a successful `try_take`)
// yields a `Quiesced`, which owns them.
use quiesce_batch::sim::SimBuf;
use quiesce_batch::Ticket;

fn take(ticket: Ticket<SimBuf>) -> Vec<SimBuf> {
    ticket.buffers()
}

fn main() {
    let _ = take;
}
