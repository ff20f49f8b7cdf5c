//! Mooncake's call arguments that are not plain values: the transfer
//! opcode (`TransferEngine.TransferOpcode`, or Mooncake's 0 and 1) and the
//! `notify` argument, which quiesce does not support.

use pyo3::prelude::*;
use quiesce_batch::sync::Direction;

/// Mooncake's opcode enum (`TransferEngine.TransferOpcode.Read` / `.Write`).
#[pyclass(module = "quiesce._native", eq, eq_int, from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TransferOpcode {
    /// Remote → local.
    Read = 0,
    /// Local → remote.
    Write = 1,
}

#[pymethods]
impl TransferOpcode {
    /// `TransferOpcode(1)`, as Mooncake's pybind11 enum takes it.
    #[new]
    fn new(value: i64) -> PyResult<Self> {
        match value {
            0 => Ok(TransferOpcode::Read),
            1 => Ok(TransferOpcode::Write),
            v => Err(pyo3::exceptions::PyValueError::new_err(format!(
                "opcode {v}: TransferOpcode.Read (0) or TransferOpcode.Write (1)"
            ))),
        }
    }

    /// Its int's hash: it equals its int, so a set or a dict keyed by
    /// opcodes finds it by either (as pybind11's enums do).
    fn __hash__(&self) -> isize {
        *self as isize
    }

    /// `"Read"` or `"Write"`, as pybind11's enums name their members.
    #[getter]
    fn name(&self) -> &'static str {
        match self {
            TransferOpcode::Read => "Read",
            TransferOpcode::Write => "Write",
        }
    }

    /// 0 or 1.
    #[getter]
    fn value(&self) -> i64 {
        *self as i64
    }
}

/// The direction `opcode` names.
pub(crate) fn direction(opcode: &Bound<'_, PyAny>) -> PyResult<Direction> {
    let op = match opcode.extract::<TransferOpcode>() {
        Ok(op) => op,
        Err(_) => match opcode.extract::<i64>()? {
            0 => TransferOpcode::Read,
            1 => TransferOpcode::Write,
            v => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "opcode {v}: TransferOpcode.Read (0) or TransferOpcode.Write (1)"
                )))
            }
        },
    };
    Ok(match op {
        TransferOpcode::Read => Direction::Read,
        TransferOpcode::Write => Direction::Write,
    })
}

/// Refuses a `notify` argument other than None.
pub(crate) fn refuse_notify(notify: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    match notify {
        Some(n) if !n.is_none() => Err(pyo3::exceptions::PyNotImplementedError::new_err(
            "notify is not supported by quiesce.mooncake",
        )),
        _ => Ok(()),
    }
}
