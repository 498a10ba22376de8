//! Gradient quantizers: each has an encoder, a dense decoder, a `GradSource` that lets
//! the store apply a payload without materialising the dense gradient, and a ratio.
pub mod int8;
pub mod onebit;
pub mod threshold;

/// Reads little-endian f32s from `bytes` (a multiple of 4 long).
pub(crate) fn read_f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
