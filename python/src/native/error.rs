//! The exceptions of the native API (defined in `quiesce/errors.py`, so
//! that they can also be `ValueError`s) and how errors map onto them.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;
use quiesce_batch::sync::SyncError;
use quiesce_batch::BatchError;
use quiesce_transports::TransferError;

/// An exception of class `kind` from `quiesce.errors`.
pub(crate) fn raise(py: Python<'_>, kind: &str, msg: &str) -> PyErr {
    let class = py
        .import("quiesce.errors")
        .and_then(|m| m.getattr(kind))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    match class {
        Ok(c) => PyErr::from_type(c, msg.to_string()),
        Err(e) => PyRuntimeError::new_err(format!("{msg} (and quiesce.errors.{kind}: {e})")),
    }
}

/// `EngineClosed` saying whether the memory the call was about stays
/// held for good (the close could not drain).
pub(crate) fn engine_closed(py: Python<'_>, buffers_held: bool) -> PyErr {
    let msg = if buffers_held {
        "the engine was closed without draining: its memory stays held for good"
    } else {
        "the engine has stopped"
    };
    let made = py.import("quiesce.errors").and_then(|m| {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("buffers_held", buffers_held)?;
        m.getattr("EngineClosed")?.call((msg,), Some(&kwargs))
    });
    match made {
        Ok(e) => PyErr::from_value(e),
        Err(e) => PyRuntimeError::new_err(format!("{msg} (and quiesce.errors.EngineClosed: {e})")),
    }
}

/// Bad input of no more precise kind.
pub(crate) fn invalid(py: Python<'_>, msg: &str) -> PyErr {
    raise(py, "InvalidInput", msg)
}

/// A zero-length task.
pub(crate) fn zero_length(py: Python<'_>, msg: &str) -> PyErr {
    raise(py, "ZeroLength", msg)
}

/// The exception class for a sync-engine error.
pub(crate) fn from_sync(py: Python<'_>, e: &SyncError) -> PyErr {
    let kind = match e {
        // A stop whose drain left operations live: whatever memory the call
        // was about is held for good (a plain error would say it is yours).
        SyncError::Undrained(_) => return engine_closed(py, true),
        SyncError::Stopped => "EngineClosed",
        SyncError::UnknownSegment(_)
        | SyncError::UnknownTicket(_)
        | SyncError::NotLent(_)
        | SyncError::NotHostMemory { .. } => "InvalidInput",
        SyncError::StillLent(_) => "StillLent",
        SyncError::Batch(BatchError::Empty) => "ZeroLength",
        SyncError::Revoke(quiesce_transports::RevokeError::KeysLive { .. }) => "QuiesceError",
        SyncError::Batch(_) | SyncError::Revoke(_) | SyncError::Register(_) => "InvalidInput",
        SyncError::Transfer(t) => transfer_kind(t),
        SyncError::Setup(_) | SyncError::Forked => "QuiesceError",
    };
    raise(py, kind, &e.to_string())
}

fn transfer_kind(t: &TransferError) -> &'static str {
    match t {
        TransferError::OpenRefused(_)
        | TransferError::NoSuchSegment(_)
        | TransferError::Forbidden(_)
        | TransferError::RemoteAccess(_)
        | TransferError::Unreachable { .. } => "SegmentRefused",
        TransferError::OutOfBounds { .. } => "OutOfBounds",
        TransferError::BadLength(_) => "InvalidInput",
        TransferError::Handshake { .. }
        | TransferError::ConnectionLost(_)
        | TransferError::NotSent(_)
        | TransferError::ConnectTimeout => "PeerUnreachable",
        _ => "QuiesceError",
    }
}
