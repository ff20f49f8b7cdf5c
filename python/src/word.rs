//! Addresses and lengths as Python passes them: `int`s, one by one or in
//! lists.
//!
//! pyo3 extracts a `usize` through `PyLong_AsUnsignedLongLong`, which in
//! CPython up to 3.12 sends any `int` of more than one 30-bit digit — every
//! address — through the generic `_PyLong_AsByteArray`: ~100 instructions
//! per address, two per transfer, 128 for a 64-transfer batch.
//! `PyLong_AsUnsignedLong` (64 bits here) reads the digits directly. What
//! is not an `int` (a NumPy integer: anything with `__index__`) still goes
//! through pyo3's conversion, and errors are the same: `OverflowError` for
//! a negative or too large value, `TypeError` for anything else.

use std::ffi::c_ulong;

use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyTuple};
use pyo3::{ffi, Borrowed};

/// A non-negative Python integer of at most 64 bits: an address or a
/// length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Word(pub(crate) usize);

impl FromPyObject<'_, '_> for Word {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Word> {
        if size_of::<c_ulong>() < size_of::<usize>() || !obj.is_instance_of::<PyInt>() {
            return obj.extract::<usize>().map(Word);
        }
        // SAFETY: `obj` is a live `int` (checked above) and the GIL is held
        // (a `Borrowed` exists only under it).
        let v = unsafe { ffi::PyLong_AsUnsignedLong(obj.as_ptr()) };
        if v == c_ulong::MAX {
            if let Some(e) = PyErr::take(obj.py()) {
                return Err(e);
            }
        }
        Ok(Word(v as usize))
    }
}

/// A sequence of [`Word`]s (a list, a tuple, or any other sequence but a
/// `str`), as the batch calls take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Words(pub(crate) Vec<usize>);

impl std::ops::Deref for Words {
    type Target = Vec<usize>;

    fn deref(&self) -> &Vec<usize> {
        &self.0
    }
}

impl FromPyObject<'_, '_> for Words {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Words> {
        let each = |items: &mut dyn ExactSizeIterator<Item = Bound<'_, PyAny>>| {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                out.push(item.extract::<Word>()?.0);
            }
            Ok(Words(out))
        };
        if let Ok(list) = obj.cast::<PyList>() {
            return each(&mut list.iter());
        }
        if let Ok(tuple) = obj.cast::<PyTuple>() {
            return each(&mut tuple.iter());
        }
        obj.extract::<Vec<usize>>().map(Words)
    }
}
