//! `dniasync._core.ThresholdCodec`.
use crate::arrays::{readonly, slice};
use crate::codec::codec_class;
use dniasync_core::quant::{threshold, Codec};
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

    /// Dense bytes over the bytes of `codes`.
    fn compression_ratio(&self, codes: &Bound<'_, PyAny>) -> PyResult<f64> {
        let codes = readonly::<u32>(codes, "codes")?;
        Ok(threshold::compression_ratio(self.0.codec().n(), slice(&codes).len()))
    }
}
