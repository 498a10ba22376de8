//! Python exceptions and the one helper every binding uses to run core code.
use dniasync_core::CoreError;
use pyo3::exceptions::{
    PyFileExistsError, PyFileNotFoundError, PyKeyError, PyOSError, PyValueError,
};
use pyo3::prelude::*;

pyo3::create_exception!(
    dniasync._core,
    NonFiniteGradientError,
    PyValueError,
    "A gradient contained NaN or Inf; the update was rejected and counted."
);
pyo3::create_exception!(
    dniasync._core,
    LayoutMismatchError,
    PyValueError,
    "A shared-memory store exists with a different layout than the one expected."
);

/// Converts a core error into the Python exception documented in `_core.pyi`.
pub fn to_py(err: CoreError) -> PyErr {
    let msg = err.to_string();
    match err {
        CoreError::UnknownSegment(_) => PyKeyError::new_err(msg),
        CoreError::NonFinite { .. } => NonFiniteGradientError::new_err(msg),
        CoreError::LayoutMismatch(_) => LayoutMismatchError::new_err(msg),
        CoreError::AlreadyExists(_) => PyFileExistsError::new_err(msg),
        CoreError::NotFound(_) => PyFileNotFoundError::new_err(msg),
        CoreError::Io { .. } => PyOSError::new_err(msg),
        CoreError::LengthMismatch { .. } | CoreError::InvalidArgument(_) => {
            PyValueError::new_err(msg)
        }
    }
}

/// Work on fewer elements than this is cheaper than releasing and retaking the GIL.
const DETACH_MIN_ELEMS: usize = 1024;

/// Size hint for calls that may block (system calls, waiting on another process).
pub const BLOCKING: usize = usize::MAX;

/// Runs core work touching about `elems` f32-sized elements, with the GIL released when
/// that is more than a few KB, and maps its error to a Python exception.
pub fn run<T: Send>(
    py: Python<'_>,
    elems: usize,
    work: impl FnOnce() -> dniasync_core::Result<T> + Send,
) -> PyResult<T> {
    if elems >= DETACH_MIN_ELEMS {
        py.detach(work).map_err(to_py)
    } else {
        work().map_err(to_py)
    }
}
