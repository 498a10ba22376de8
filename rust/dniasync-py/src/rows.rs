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

/// A shard's batches read straight from its files' mappings (see `dniasync_core::rows::Blocks`).
#[pyclass(frozen)]
pub struct BlockRows {
    /// Each file's mapping as (address, length); the arrays in `keep` own them.
    srcs: Vec<Option<(usize, usize)>>,
    keep: Vec<Py<PyAny>>,
    bounds: Vec<i64>,
    file: Vec<i64>,
    x: Vec<i64>,
    y: Vec<i64>,
    row_len: usize,
    scale: f32,
}

#[pymethods]
impl BlockRows {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        srcs: Vec<Option<Bound<'_, PyAny>>>,
        bounds: Vec<i64>,
        file: Vec<i64>,
        x: Vec<i64>,
        y: Vec<i64>,
        row_len: usize,
        scale: f32,
    ) -> PyResult<Self> {
        let mut spans = Vec::with_capacity(srcs.len());
        let mut keep = Vec::new();
        for src in srcs {
            match src {
                None => spans.push(None),
                Some(obj) => {
                    let arr = readonly::<u8>(&obj, "srcs")?;
                    let bytes = slice(&arr);
                    spans.push(Some((bytes.as_ptr() as usize, bytes.len())));
                    keep.push(obj.unbind());
                }
            }
        }
        Ok(BlockRows {
            srcs: spans,
            keep,
            bounds,
            file,
            x,
            y,
            row_len,
            scale,
        })
    }

    /// The batch at `positions` into `out_x` (float32) and `out_y` (int64); False where a
    /// position is not served here (the caller reads it another way).
    fn take(
        &self,
        py: Python<'_>,
        positions: &Bound<'_, PyAny>,
        out_x: &Bound<'_, PyAny>,
        out_y: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let positions = readonly::<i64>(positions, "positions")?;
        let mut out_x = readwrite::<f32>(out_x, "out_x")?;
        let mut out_y = readwrite::<i64>(out_y, "out_y")?;
        let positions = slice(&positions);
        let out_x = out_x
            .as_slice_mut()
            .expect("contiguity checked in `readwrite`");
        let out_y = out_y
            .as_slice_mut()
            .expect("contiguity checked in `readwrite`");
        debug_assert!(self.keep.len() <= self.srcs.len());
        // SAFETY: each (address, length) is the buffer of an array in `self.keep`, read-only and
        // alive as long as this object; memory-mapped files do not move.
        let srcs: Vec<Option<&[u8]>> = self
            .srcs
            .iter()
            .map(|s| s.map(|(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) }))
            .collect();
        let blocks = rows::Blocks {
            bounds: &self.bounds,
            file: &self.file,
            x: &self.x,
            y: &self.y,
        };
        run(py, out_x.len(), || {
            rows::gather_blocks_u8(
                &srcs,
                &blocks,
                positions,
                self.row_len,
                self.scale,
                out_x,
                out_y,
            )
        })
    }
}
