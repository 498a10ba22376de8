//! `dniasync._core.gather_rows_u8`: a converted data set's batch, gathered from its mapping.
use crate::arrays::{readonly, readwrite, slice};
use crate::errors::run;
use dniasync_core::rows;
use pyo3::prelude::*;

/// Rows of `row_len` uint8 features at byte `offsets` of `src` into `out` (float32), divided by `scale`.
#[pyfunction]
pub fn gather_rows_u8(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    offsets: &Bound<'_, PyAny>,
    row_len: usize,
    scale: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let src = readonly::<u8>(src, "src")?;
    let offsets = readonly::<i64>(offsets, "offsets")?;
    let mut out = readwrite::<f32>(out, "out")?;
    let (src, offsets) = (slice(&src), slice(&offsets));
    let out = out
        .as_slice_mut()
        .expect("contiguity checked in `readwrite`");
    run(py, out.len(), || {
        rows::gather_u8_scaled(src, offsets, row_len, scale, out)
    })
}
