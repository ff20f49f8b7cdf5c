//! `quiesce._native`: the Rust half of the `quiesce` Python package.
//!
//! `mooncake::TransferEngine` is the surface vLLM's and SGLang's Mooncake
//! connectors call (`quiesce.mooncake.TransferEngine` re-exports it), on
//! quiesce's sync engine: every call blocks with the GIL released, and its
//! code keeps quiesce's contract — 0 completed, -1 failed and nothing
//! touches the caller's memory any more, -2 completion unknown (the memory
//! stays pinned until `TransferEngine.wait_for_quiescence()`
//! says the batch drained).
#![deny(missing_docs)]

use pyo3::prelude::*;

mod log;
mod managed;
mod mooncake;
mod native;
mod node;
mod opcode;
mod word;

/// The extension module. It needs the GIL (`gil_used = true`, which pyo3
/// no longer assumes): some of its invariants hold only because two
/// Python calls cannot interleave — e.g. a delivered batch moves from the
/// engine's flights to its tickets in two steps that a concurrent
/// `wait_for_quiescence` must not see apart. On a free-threaded
/// interpreter the import turns the GIL back on (with its warning).
#[pymodule(gil_used = true)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    log::install();
    m.add_function(wrap_pyfunction!(log::next_log_records, m)?)?;
    m.add_function(wrap_pyfunction!(log::close_log_records, m)?)?;
    m.add_function(wrap_pyfunction!(log::hold_log_records_for_fork, m)?)?;
    m.add_function(wrap_pyfunction!(log::release_log_records_after_fork, m)?)?;
    m.add_function(wrap_pyfunction!(log::set_log_filter, m)?)?;
    m.add("LOG_ENV", log::LOG_ENV)?;
    m.add("DEFAULT_LOG_FILTER", log::DEFAULT_FILTER)?;
    m.add_class::<mooncake::TransferEngine>()?;
    m.add_class::<opcode::TransferOpcode>()?;
    m.add_class::<native::NativeEngine>()?;
    m.add_class::<native::batch::NativeBatch>()?;
    m.add("SECRET_ENV", node::SECRET_ENV)?;
    m.add("OPEN_CLUSTER_ENV", node::OPEN_CLUSTER_ENV)?;
    Ok(())
}
