//! `dniasync._core.OneBitCodec`.
use crate::codec::codec_class;
use dniasync_core::quant::{onebit, Codec};
use pyo3::prelude::*;

codec_class! {
    /// 1-bit SGD quantizer with error feedback: a sign bit per element and, per block, the
    /// means of the non-negative and of the negative values; the error is carried here.
    /// Payload: uint8 bytes, per block two little-endian float32 means, then the bits.
    OneBitCodec(onebit::OneBitCodec) {
        new(n: usize, block: usize = 256),
        get { block: usize },
        payload: payload,
        carried: error,
        encode: "Encodes `grad` plus the carried error; keeps the new error.",
    }

    /// Dense bytes over payload bytes (fixed for this codec and length).
    fn compression_ratio(&self) -> f64 {
        onebit::compression_ratio(self.0.codec().n(), self.block())
    }
}
