//! Where an update's values come from: a dense slice, or a compressed payload
//! decoded chunk by chunk so that no dense gradient is ever materialised.
use crate::simd;

/// A gradient (or delta) of known length that the store reads in order, chunk by chunk.
pub trait GradSource {
    /// Number of elements.
    fn len(&self) -> usize;

    /// True when the source has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..start + buf.len()`: either borrowed from the source or decoded into `buf`.
    /// Called once per chunk, in any order (passes may start mid-vector and wrap around).
    fn chunk<'a>(&'a mut self, start: usize, buf: &'a mut [f32]) -> &'a [f32];

    /// Squared L2 norm (NaN or Inf when some element is not finite).
    fn norm_sq(&self) -> f64;

    /// True when every element is finite.
    fn all_finite(&self) -> bool;

    /// For sparse sources, the packed (sign, index) codes and the magnitude of each nonzero.
    fn sparse(&self) -> Option<(&[u32], f32)> {
        None
    }
}

/// A plain dense slice.
pub struct Dense<'a>(pub &'a [f32]);

impl GradSource for Dense<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    #[inline]
    fn chunk<'a>(&'a mut self, start: usize, buf: &'a mut [f32]) -> &'a [f32] {
        &self.0[start..start + buf.len()]
    }

    fn norm_sq(&self) -> f64 {
        simd::norm_sq(self.0)
    }

    fn all_finite(&self) -> bool {
        simd::all_finite(self.0)
    }
}
