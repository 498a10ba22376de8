//! `dniasync._core.ThresholdCodec`.
use crate::arrays::{readonly, slice};
use crate::errors::run;
use crate::store::{ParamStore, Update};
use dniasync_core::quant::threshold::{self, ThresholdEncoder, ThresholdGrad};
use numpy::PyArray1;
use pyo3::prelude::*;
use std::sync::Mutex;

/// Strom threshold quantizer: residual kept here, codes are uint32 (bit 31 sign, index),
/// and decode yields exactly ±tau at each coded index.
#[pyclass(frozen, module = "dniasync._core")]
pub struct ThresholdCodec {
    encoder: Mutex<ThresholdEncoder>,
    n: usize,
    tau: f32,
}

impl ThresholdCodec {
    fn encoder(&self) -> std::sync::MutexGuard<'_, ThresholdEncoder> {
        // A panic mid-encode cannot leave the residual half-typed: f32 writes are whole.
        self.encoder.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl ThresholdCodec {
    #[new]
    fn new(n: usize, tau: f32) -> PyResult<Self> {
        let encoder = ThresholdEncoder::new(n, tau).map_err(crate::errors::to_py)?;
        Ok(ThresholdCodec {
            encoder: Mutex::new(encoder),
            n,
            tau,
        })
    }

    #[getter]
    fn n(&self) -> usize {
        self.n
    }

    #[getter]
    fn tau(&self) -> f32 {
        self.tau
    }

    /// Adds `grad` to the residual and returns the codes of elements that reached ±tau.
    fn encode<'py>(
        &self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let grad = readonly::<f32>(grad, "grad")?;
        let grad = slice(&grad);
        let codes = run(py, grad.len(), || {
            let mut out = Vec::new();
            self.encoder().encode(grad, &mut out)?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, codes))
    }

    /// Dense float32 gradient: ±tau at each coded index, 0 elsewhere.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        codes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let codes = readonly::<u32>(codes, "codes")?;
        let codes = slice(&codes);
        let out = run(py, self.n, || {
            let mut out = vec![0f32; self.n];
            threshold::decode(codes, self.tau, &mut out)?;
            Ok(out)
        })?;
        Ok(PyArray1::from_vec(py, out))
    }

    /// One optimizer step of `store` with the decoded gradient, without materialising it.
    fn apply(
        &self,
        py: Python<'_>,
        store: &Bound<'_, ParamStore>,
        segment: &str,
        codes: &Bound<'_, PyAny>,
        lr: f32,
    ) -> PyResult<u64> {
        let codes = readonly::<u32>(codes, "codes")?;
        let codes = slice(&codes);
        let update = Update::Step(lr);
        store.get().update(py, segment, self.n, update, || {
            ThresholdGrad::new(codes, self.tau, self.n)
        })
    }

    /// `w += alpha * decoded` on `store` (no optimizer), touching only the coded elements.
    #[pyo3(signature = (store, segment, codes, alpha = 1.0))]
    fn add_to(
        &self,
        py: Python<'_>,
        store: &Bound<'_, ParamStore>,
        segment: &str,
        codes: &Bound<'_, PyAny>,
        alpha: f32,
    ) -> PyResult<u64> {
        let codes = readonly::<u32>(codes, "codes")?;
        let codes = slice(&codes);
        let update = Update::Add(alpha);
        store.get().update(py, segment, codes.len(), update, || {
            ThresholdGrad::new(codes, self.tau, self.n)
        })
    }

    /// Copy of the residual carried to the next encode.
    fn residual<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        PyArray1::from_slice(py, self.encoder().residual())
    }

    fn reset(&self) {
        self.encoder().reset();
    }

    /// Dense bytes over the bytes of `codes`.
    fn compression_ratio(&self, codes: &Bound<'_, PyAny>) -> PyResult<f64> {
        let codes = readonly::<u32>(codes, "codes")?;
        Ok(threshold::compression_ratio(self.n, slice(&codes).len()))
    }
}
