//! Checked conversions between numpy arrays and slices.
use numpy::{
    Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

fn checked<'a, 'py, T: Element>(
    obj: &'a Bound<'py, PyAny>,
    what: &str,
) -> PyResult<&'a Bound<'py, PyArrayDyn<T>>> {
    let py = obj.py();
    let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
        let ty = obj
            .get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string());
        PyTypeError::new_err(format!(
            "{what} must be a numpy.ndarray of {}, got {ty}",
            numpy::dtype::<T>(py)
        ))
    })?;
    let want = numpy::dtype::<T>(py);
    if !arr.dtype().is_equiv_to(&want) {
        return Err(PyTypeError::new_err(format!(
            "{what} must have dtype {want}, got {}",
            arr.dtype()
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what} must be C-contiguous (numpy.ascontiguousarray makes a contiguous copy)"
        )));
    }
    let typed = obj.cast::<PyArrayDyn<T>>()?;
    // A slice of T must be aligned; byte buffers from the network may not be.
    if !(typed.data() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(PyValueError::new_err(format!(
            "{what} is not aligned to {} bytes (copy it: numpy.array(a))",
            std::mem::align_of::<T>()
        )));
    }
    Ok(typed)
}

/// A read-only borrow of a contiguous array of `T` (any shape, read flat).
pub fn readonly<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    checked::<T>(obj, what)?
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
}

/// A writable borrow of a contiguous array of `T` (any shape, written flat).
pub fn readwrite<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    checked::<T>(obj, what)?
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
}

/// Slice of a contiguous borrow (contiguity was checked on the way in).
pub fn slice<'a, T: Element>(arr: &'a PyReadonlyArrayDyn<'_, T>) -> &'a [T] {
    arr.as_slice().expect("contiguity checked in `checked`")
}
