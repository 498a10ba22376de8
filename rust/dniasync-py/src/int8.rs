//! `dniasync._core.Int8Codec`.
use crate::arrays::{readonly, slice};
use crate::errors::{run, to_py};
use crate::store::{ParamStore, Update};
use dniasync_core::quant::int8::{self, Int8Grad};
use numpy::PyArray1;
use pyo3::prelude::*;

/// 8-bit blockwise quantizer: one float32 scale per block (max |g| / 127) and one int8 per
/// element; stateless. Payload: uint8 bytes, the little-endian float32 scales, then the codes.
#[pyclass(frozen, module = "dniasync._core")]
pub struct Int8Codec {
    n: usize,
    block: usize,
}

#[pymethods]
impl Int8Codec {
    #[new]
    #[pyo3(signature = (n, block = 256))]
    fn new(n: usize, block: usize) -> PyResult<Self> {
        if block == 0 {
            return Err(to_py(dniasync_core::CoreError::InvalidArgument(
                "block must be positive".into(),
            )));
        }
        Ok(Int8Codec { n, block })
    }

    #[getter]
    fn n(&self) -> usize {
        self.n
    }

    #[getter]
    fn block(&self) -> usize {
        self.block
    }

    fn encode<'py>(
        &self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let grad = readonly::<f32>(grad, "grad")?;
        let grad = slice(&grad);
        let payload = run(py, grad.len(), || {
            dniasync_core::error::check_len("gradient", self.n, grad.len())?;
            let mut out = Vec::new();
            int8::encode(grad, self.block, &mut out)?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, payload))
    }

    /// Dense float32 gradient decoded from `payload`.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        payload: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let payload = readonly::<u8>(payload, "payload")?;
        let payload = slice(&payload);
        let out = run(py, self.n, || {
            let mut out = vec![0f32; self.n];
            int8::decode(payload, self.block, &mut out)?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, out))
    }

    /// One optimizer step of `store` with the decoded gradient, decoded chunk by chunk.
    fn apply(
        &self,
        py: Python<'_>,
        store: &Bound<'_, ParamStore>,
        segment: &str,
        payload: &Bound<'_, PyAny>,
        lr: f32,
    ) -> PyResult<u64> {
        let payload = readonly::<u8>(payload, "payload")?;
        let payload = slice(&payload);
        let update = Update::Step(lr);
        store.get().update(py, segment, self.n, update, || {
            Int8Grad::new(payload, self.n, self.block)
        })
    }

    /// `w += alpha * decoded` on `store` (no optimizer), decoded chunk by chunk.
    #[pyo3(signature = (store, segment, payload, alpha = 1.0))]
    fn add_to(
        &self,
        py: Python<'_>,
        store: &Bound<'_, ParamStore>,
        segment: &str,
        payload: &Bound<'_, PyAny>,
        alpha: f32,
    ) -> PyResult<u64> {
        let payload = readonly::<u8>(payload, "payload")?;
        let payload = slice(&payload);
        let update = Update::Add(alpha);
        store.get().update(py, segment, self.n, update, || {
            Int8Grad::new(payload, self.n, self.block)
        })
    }

    /// Dense bytes over payload bytes (fixed for this codec and length).
    fn compression_ratio(&self) -> f64 {
        int8::compression_ratio(self.n, self.block)
    }
}
