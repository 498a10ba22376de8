//! Gradient quantizers: each has an encoder, a dense decoder, a `GradSource` that lets
//! the store apply a payload without materialising the dense gradient, and a ratio.
//! [`Codec`] is what the three have in common, so callers handle any of them one way.
use crate::error::Result;
use crate::grad::GradSource;

pub mod int8;
pub mod onebit;
pub mod threshold;

/// A codec's parameters for vectors of `n()` elements: everything decoding needs.
/// What a sender carries between encodes is a separate `Encoder`, so decoding and
/// applying payloads never wait on an encode.
pub trait Codec: Sync {
    /// One element of a payload (`u32` codes, `u8` bytes).
    type Code: Copy + Send + Sync;
    /// The sender's state between encodes (residual, error feedback, or nothing).
    type Encoder: Send;
    /// A payload read as a gradient source, decoded on the fly.
    type Grad<'a>: GradSource
    where
        Self: 'a;

    /// Elements of the dense gradient.
    fn n(&self) -> usize;

    /// A sender state carrying nothing yet.
    fn encoder(&self) -> Self::Encoder;

    /// Encodes `grad` with what `encoder` carries into `out` (cleared first); updates the
    /// carried state. A gradient with NaN/Inf is rejected before anything changes.
    fn encode(
        &self,
        encoder: &mut Self::Encoder,
        grad: &[f32],
        out: &mut Vec<Self::Code>,
    ) -> Result<()>;

    /// What `encoder` carries into the next encode: the residual or the error fed back
    /// (empty for a stateless codec).
    fn carried<'e>(&self, encoder: &'e Self::Encoder) -> &'e [f32];

    /// Forgets what `encoder` carries.
    fn reset(&self, encoder: &mut Self::Encoder);

    /// Dense decode of `payload` into `out` (`n()` elements, overwritten).
    fn decode(&self, payload: &[Self::Code], out: &mut [f32]) -> Result<()>;

    /// `payload` checked against `n()` elements, as a gradient source for the store.
    fn grad<'a>(&'a self, payload: &'a [Self::Code]) -> Result<Self::Grad<'a>>;

    /// Elements a plain add of `payload` touches: all of them unless the codec is sparse.
    fn touched(&self, _payload: &[Self::Code]) -> usize {
        self.n()
    }
}

/// Reads little-endian f32s from `bytes` (a multiple of 4 long).
pub(crate) fn read_f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
