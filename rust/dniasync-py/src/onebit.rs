//! `dniasync._core.OneBitCodec`.
use crate::arrays::{readonly, slice};
use crate::errors::{run, to_py};
use crate::store::{ParamStore, Update};
use dniasync_core::quant::onebit::OneBitEncoder;
use dniasync_core::quant::onebit::{self, OneBitGrad};
use numpy::PyArray1;
use pyo3::prelude::*;
use std::sync::Mutex;

/// 1-bit SGD quantizer with error feedback: a sign bit per element and, per block, the
/// means of the non-negative and of the negative values; the error is carried here.
/// Payload: uint8 bytes, per block two little-endian float32 means, then the bits.
#[pyclass(frozen, module = "dniasync._core")]
pub struct OneBitCodec {
    encoder: Mutex<OneBitEncoder>,
    n: usize,
    block: usize,
}

impl OneBitCodec {
    fn encoder(&self) -> std::sync::MutexGuard<'_, OneBitEncoder> {
        // A panic mid-encode cannot leave the error half-typed: f32 writes are whole.
        self.encoder.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl OneBitCodec {
    #[new]
    #[pyo3(signature = (n, block = 256))]
    fn new(n: usize, block: usize) -> PyResult<Self> {
        let encoder = OneBitEncoder::new(n, block).map_err(to_py)?;
        Ok(OneBitCodec {
            encoder: Mutex::new(encoder),
            n,
            block,
        })
    }

    #[getter]
    fn n(&self) -> usize {
        self.n
    }

    #[getter]
    fn block(&self) -> usize {
        self.block
    }

    /// Encodes `grad` plus the carried error; keeps the new error.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u8>>> {
        let grad = readonly::<f32>(grad, "grad")?;
        let grad = slice(&grad);
        let payload = run(py, grad.len(), || {
            let mut out = Vec::new();
            self.encoder().encode(grad, &mut out)?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, payload))
    }

    /// Copy of the quantization error carried to the next encode.
    fn error<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        PyArray1::from_slice(py, self.encoder().error())
    }

    fn reset(&self) {
        self.encoder().reset();
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
            onebit::decode(payload, self.block, &mut out)?;
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
            OneBitGrad::new(payload, self.n, self.block)
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
            OneBitGrad::new(payload, self.n, self.block)
        })
    }

    /// Dense bytes over payload bytes (fixed for this codec and length).
    fn compression_ratio(&self) -> f64 {
        onebit::compression_ratio(self.n, self.block)
    }
}
