//! `dniasync._core.Int8Codec`.
use crate::codec::codec_class;
use dniasync_core::quant::{int8, Codec};
use pyo3::prelude::*;

codec_class! {
    /// 8-bit blockwise quantizer: one float32 scale per block (max |g| / 127) and one int8 per
    /// element; stateless. Payload: uint8 bytes, the little-endian float32 scales, then the codes.
    Int8Codec(int8::Int8Codec) {
        new(n: usize, block: usize = 256),
        get { block: usize },
        payload: payload,
        encode: "Encodes `grad`; nothing is carried to the next encode.",
    }

    /// Dense bytes over payload bytes (fixed for this codec and length).
    fn compression_ratio(&self) -> f64 {
        int8::compression_ratio(self.0.codec().n(), self.block())
    }
}
