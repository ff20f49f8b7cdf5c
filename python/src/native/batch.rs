//! `NativeBatch`: the tasks of a native-API batch, each holding its buffer
//! from the moment it is added until the batch has quiesced.

use pyo3::prelude::*;
use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{Direction, SyncTask};

use super::engine_state::Report;
use super::error::{invalid, raise};
use super::pin::{Access, Held};

/// What the engine moves: each task's direction, buffer and range.
pub(crate) type Moves = Vec<(Direction, SyncTask<RawBuf>)>;

/// One task: its buffer, and where in a remote segment it goes or comes from.
pub(crate) struct Planned {
    dir: Direction,
    held: Held,
    segment: u32,
    offset: u64,
}

/// A batch being built (Python's `quiesce.Batch` wraps it).
#[pyclass(module = "quiesce._native")]
pub struct NativeBatch {
    /// `None` once it ran.
    tasks: Option<Vec<Planned>>,
    /// The report of a blocking run, kept for a caller that did not get
    /// the return value (a KeyboardInterrupt raised as the call returned).
    pub(crate) ran: Option<Report>,
}

#[pymethods]
impl NativeBatch {
    #[new]
    fn new() -> Self {
        NativeBatch {
            tasks: Some(Vec::new()),
            ran: None,
        }
    }

    /// What a blocking `run` of this batch answered (`None` before).
    fn ran(&self) -> Option<Report> {
        self.ran.clone()
    }

    /// Adds a task moving all of `buffer` to (`write`) or from the remote
    /// segment `segment` (`segment_len` bytes) at `offset`; holds the buffer
    /// from now on. Returns the task's index.
    fn add(
        &mut self,
        py: Python<'_>,
        write: bool,
        buffer: &Bound<'_, PyAny>,
        segment: u32,
        segment_len: u64,
        offset: u64,
    ) -> PyResult<usize> {
        let Some(tasks) = self.tasks.as_mut() else {
            return Err(invalid(py, "this batch has run already"));
        };
        let (dir, access) = if write {
            (Direction::Write, Access::Read)
        } else {
            (Direction::Read, Access::Write)
        };
        let held = Held::new(buffer, access)?;
        if offset
            .checked_add(held.len as u64)
            .is_none_or(|end| end > segment_len)
        {
            let len = held.len;
            held.release(py);
            return Err(raise(
                py,
                "OutOfBounds",
                &format!(
                    "{len} bytes at offset {offset} cross the end of a {segment_len}-byte segment"
                ),
            ));
        }
        tasks.push(Planned {
            dir,
            held,
            segment,
            offset,
        });
        Ok(tasks.len() - 1)
    }

    pub(crate) fn __len__(&self) -> usize {
        self.tasks.as_ref().map_or(0, Vec::len)
    }
}

impl Drop for NativeBatch {
    fn drop(&mut self) {
        // Never run: nothing but this batch holds the buffers.
        if let Some(tasks) = self.tasks.take() {
            Python::try_attach(|py| tasks.into_iter().for_each(|t| t.held.release(py)));
        }
    }
}

impl NativeBatch {
    /// Takes the tasks out to run them: what the engine moves, and what
    /// holds the memory meanwhile (index for index).
    pub(crate) fn take(&mut self, py: Python<'_>) -> PyResult<(Moves, Vec<Held>)> {
        let Some(planned) = self.tasks.take() else {
            return Err(invalid(py, "this batch has run already"));
        };
        if planned.is_empty() {
            return Err(invalid(py, "the batch has no tasks"));
        }
        let mut tasks = Vec::with_capacity(planned.len());
        let mut held = Vec::with_capacity(planned.len());
        for p in planned {
            // SAFETY: `Held` keeps the memory valid and in place until the
            // batch's outcome (only an outcome, or an engine that drained,
            // releases it; one that cannot drain leaks it). A read-only
            // export is taken only as a write's source, which the engine
            // only reads. That Python code leaves it alone meanwhile is the
            // caller's promise, as with Mooncake (documented on `Batch`).
            let buf = unsafe { RawBuf::new(p.held.addr as *mut u8, p.held.len) };
            tasks.push((
                p.dir,
                SyncTask {
                    segment: p.segment,
                    offset: p.offset,
                    buf,
                },
            ));
            held.push(p.held);
        }
        Ok((tasks, held))
    }
}
