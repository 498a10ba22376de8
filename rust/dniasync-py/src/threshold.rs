//! `dniasync._core.ThresholdCodec`.
use crate::arrays::{readonly, slice};
use crate::codec::codec_class;
use crate::errors::run;
use dniasync_core::quant::{threshold, Codec};
use numpy::PyArray1;
use pyo3::prelude::*;

codec_class! {
    /// Strom threshold quantizer: residual kept here, codes are uint32 (bit 31 sign, index),
    /// and decode yields exactly ±tau at each coded index.
    ThresholdCodec(threshold::ThresholdCodec) {
        new(n: usize, tau: f32),
        get { tau: f32 },
        payload: codes,
        carried: residual,
        encode: "Adds `grad` to the residual and returns the codes of elements that reached ±tau.",
    }

    /// Like `encode`, but at most `max_codes` codes: those from element `start` on (wrapping);
    /// the other elements that reached ±tau keep it in the residual. Returns the codes
    /// (ascending) and the element a next call starts from (`start` if none was left out).
    fn encode_capped<'py>(
        &self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
        max_codes: usize,
        start: usize,
    ) -> PyResult<(Bound<'py, PyArray1<u32>>, usize)> {
        let grad = readonly::<f32>(grad, "grad")?;
        let grad = slice(&grad);
        let (codes, next) = run(py, grad.len(), || {
            let mut out = Vec::new();
            let next = self.0.encoder().encode_capped(grad, max_codes, start, &mut out)?;
            Ok((out, next))
        })?;
        Ok((PyArray1::from_vec(py, codes), next))
    }

    /// Dense bytes over the bytes of `codes`.
    fn compression_ratio(&self, codes: &Bound<'_, PyAny>) -> PyResult<f64> {
        let codes = readonly::<u32>(codes, "codes")?;
        Ok(threshold::compression_ratio(self.0.codec().n(), slice(&codes).len()))
    }
}
