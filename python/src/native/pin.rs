//! Python memory a batch or a lent segment holds: a buffer-protocol export
//! (the exporter cannot resize or free it while the export is held), or a
//! strong reference to an object that gives its memory by `data_ptr()`
//! (torch CPU tensors).

use std::sync::OnceLock;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;

use quiesce_batch::sync::HostRanges;

use super::error::{invalid, zero_length};
use super::in_use::Claim;

/// Whether a buffer's struct format has items that are Python object
/// pointers (`O`; a field's `:name:` is skipped): a peer's bytes written
/// there would be taken for objects (their next decref writes where the
/// peer chose), and their bytes sent are this process's addresses.
fn holds_objects(format: &[u8]) -> bool {
    let mut in_name = false;
    format.iter().any(|&c| {
        if c == b':' {
            in_name = !in_name;
        }
        !in_name && c == b'O'
    })
}

/// What keeps the memory alive and in place.
enum Keep {
    /// A buffer-protocol export.
    Export(PyUntypedBuffer),
    /// An object with `data_ptr()`: referenced, never resized by this crate
    /// (the caller must not `resize_` it while it is held either), and its
    /// `untyped_storage()` where it has one (torch): a tensor given other
    /// storage (`set_`, `.data =`) lets go of its old one, which the
    /// transfer still uses.
    Object(Py<PyAny>, Option<Py<PyAny>>),
}

/// Caller memory held until nothing can touch it. Only [`Held::release`]
/// lets go of it (on a thread attached to Python; the engine's thread never
/// owns one): a `Held` merely dropped — left in a map when the engine could
/// not drain, or at interpreter shutdown — leaks its memory rather than hand
/// back memory a transfer may still use.
pub(crate) struct Held {
    /// `None` once released.
    keep: Option<Keep>,
    /// A batch buffer's entry among the memory this engine's batches hold
    /// (a lent segment's revoke waits for it); ended on release only.
    claim: Option<Claim>,
    /// Its first byte.
    pub(crate) addr: usize,
    /// Its length in bytes.
    pub(crate) len: usize,
}

/// Whether the memory will be written (a read's destination, a lent segment).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Only read from (a write's source).
    Read,
    /// Written into.
    Write,
}

impl Held {
    /// Holds `obj`'s memory: any C-contiguous buffer-protocol object, or an
    /// object with `data_ptr()` and `nbytes` on the CPU.
    pub(crate) fn new(obj: &Bound<'_, PyAny>, access: Access) -> PyResult<Held> {
        let py = obj.py();
        if let Ok(buf) = PyUntypedBuffer::get(obj) {
            if !buf.is_c_contiguous() {
                return Err(invalid(py, "the buffer is not C-contiguous"));
            }
            if access == Access::Write && buf.readonly() {
                return Err(invalid(
                    py,
                    "the buffer is read-only, and it would be written",
                ));
            }
            if buf.len_bytes() == 0 {
                return Err(zero_length(py, "the buffer is empty"));
            }
            if holds_objects(buf.format().to_bytes()) {
                return Err(invalid(
                    py,
                    &format!(
                        "the buffer holds Python objects (format {:?}), not bytes to move",
                        buf.format()
                    ),
                ));
            }
            let (addr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
            return Ok(Held {
                keep: Some(Keep::Export(buf)),
                claim: None,
                addr,
                len,
            });
        }
        Held::by_data_ptr(obj)
    }

    fn by_data_ptr(obj: &Bound<'_, PyAny>) -> PyResult<Held> {
        let py = obj.py();
        if !obj.hasattr("data_ptr")? {
            return Err(invalid(
                py,
                &format!(
                    "a {} is neither a buffer (bytearray, memoryview, numpy array) nor a tensor with data_ptr()",
                    obj.get_type().name()?
                ),
            ));
        }
        if obj.hasattr("device")? {
            // torch's `device.type`; a device given as a string ("cuda:0")
            // is its own.
            let device = obj.getattr("device")?;
            let kind = match device.getattr("type") {
                Ok(t) => t.str()?.to_string(),
                Err(_) => device.str()?.to_string(),
            };
            let kind = kind.split(':').next().unwrap_or_default();
            if kind != "cpu" {
                return Err(invalid(
                    py,
                    &format!("the tensor is on {kind}, not the CPU"),
                ));
            }
        }
        if obj.hasattr("is_contiguous")? && !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(invalid(py, "the tensor is not contiguous"));
        }
        // A negative or huge pointer or size is bad input, not an overflow.
        let word = |v: Bound<'_, PyAny>, what: &str| {
            v.extract::<usize>().map_err(|_| {
                invalid(
                    py,
                    &format!("the tensor's {what} is not an address-sized count"),
                )
            })
        };
        let addr = word(obj.call_method0("data_ptr")?, "data_ptr()")?;
        let len = word(obj.getattr("nbytes")?, "nbytes")?;
        if len == 0 {
            return Err(zero_length(py, "the tensor is empty"));
        }
        if addr == 0 {
            return Err(invalid(py, "the tensor has no memory"));
        }
        // Its word only: a device pointer (or a wrong one) would kill the
        // process at the first copy. A buffer export is host memory.
        static HOST: OnceLock<HostRanges> = OnceLock::new();
        if let Some((a, l)) = HOST
            .get_or_init(HostRanges::new)
            .first_bad([(addr as u64, len as u64)])
        {
            return Err(invalid(
                py,
                &format!(
                    "the tensor's memory {a:#x}..+{l} is not memory this process can read and write \
                     (device memory? quiesce moves host memory)"
                ),
            ));
        }
        let storage = match obj.hasattr("untyped_storage")? {
            true => Some(obj.call_method0("untyped_storage")?.unbind()),
            false => None,
        };
        Ok(Held {
            keep: Some(Keep::Object(obj.clone().unbind(), storage)),
            claim: None,
            addr,
            len,
        })
    }

    /// Lets go of the memory now (the GIL is held).
    pub(crate) fn release(mut self, py: Python<'_>) {
        match self.keep.take() {
            Some(Keep::Export(buf)) => buf.release(py),
            Some(Keep::Object(o, storage)) => drop((o, storage)),
            None => {}
        }
        if let Some(c) = self.claim.take() {
            c.end();
        }
    }

    /// Counts the memory as a batch's until released.
    pub(crate) fn claim(&mut self, c: Claim) {
        self.claim = Some(c);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // Not released: keep the export (or the reference) for good.
        if let Some(k) = self.keep.take() {
            std::mem::forget(k);
        }
    }
}
