//! Rows of a memory-mapped data file gathered into a float32 batch in one pass.
//!
//! A converted data set stores features as uint8 (a quarter of float32's bytes on disk and in
//! the page cache); a trainer wants float32 divided by the set's scale. Gathering the rows and
//! converting them in one pass writes each output value once and reads each source byte once,
//! straight from the mapping: a page a row lies on is faulted in here, with the interpreter
//! released. The values are bit for bit `f32` division's, numpy's
//! `np.divide(x, np.float32(scale), dtype=np.float32)`: with FMA, by a multiplication and a
//! Newton step where that gives the division's bits for all 256 byte values (checked per call,
//! 256 operations), by division otherwise.
use crate::error::{check_len, invalid, Result};
use crate::simd::{isa, Isa};

/// Copies `offsets.len()` rows of `row_len` uint8 features, row `i` starting at byte
/// `offsets[i]` of `src`, into `out` (row-major), each value divided by `scale`.
/// InvalidArgument for a row outside `src` or a scale that is zero or not finite;
/// LengthMismatch unless `out` holds exactly the rows. Nothing is written on error.
pub fn gather_u8_scaled(
    src: &[u8],
    offsets: &[i64],
    row_len: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    check_len("output batch", offsets.len() * row_len, out.len())?;
    if !(scale.is_finite() && scale != 0.0) {
        return Err(invalid(format!(
            "scale must be finite and not 0, got {scale}"
        )));
    }
    for &o in offsets {
        let inside = usize::try_from(o)
            .ok()
            .and_then(|start| start.checked_add(row_len))
            .is_some_and(|end| end <= src.len());
        if !inside {
            return Err(invalid(format!(
                "a row of {row_len} bytes at offset {o} lies outside the {} bytes mapped",
                src.len()
            )));
        }
    }
    if row_len == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let inv = 1.0 / scale;
        match isa() {
            // SAFETY: `isa()` never exceeds what the CPU was detected to have.
            Isa::Avx512 if refined_is_exact(scale, inv) => {
                unsafe { avx512(src, offsets, row_len, scale, inv, out) };
                return Ok(());
            }
            Isa::Avx2 if refined_is_exact(scale, inv) => {
                unsafe { avx2(src, offsets, row_len, scale, inv, out) };
                return Ok(());
            }
            _ => {}
        }
    }
    gather(src, offsets, row_len, |b| f32::from(b) / scale, out);
    Ok(())
}

/// `b / scale` by a multiplication and one Newton step (two fused multiply-adds): far faster
/// than a division, and correctly rounded for nearly every divisor. Only used where every
/// byte value gives the division's bits (checked by `refined_is_exact`).
#[inline(always)]
fn refined(b: u8, scale: f32, inv: f32) -> f32 {
    let x = f32::from(b);
    let q = x * inv;
    let r = (-q).mul_add(scale, x);
    r.mul_add(inv, q)
}

/// Whether `refined` gives `b / scale` bit for bit for all 256 byte values.
fn refined_is_exact(scale: f32, inv: f32) -> bool {
    (0..=255u8).all(|b| refined(b, scale, inv).to_bits() == (f32::from(b) / scale).to_bits())
}

#[inline(always)]
fn gather(src: &[u8], offsets: &[i64], row_len: usize, value: impl Fn(u8) -> f32, out: &mut [f32]) {
    for (row, &o) in out.chunks_exact_mut(row_len).zip(offsets) {
        let start = o as usize; // checked by the caller
        for (d, &s) in row.iter_mut().zip(&src[start..start + row_len]) {
            *d = value(s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn avx512(
    src: &[u8],
    offsets: &[i64],
    row_len: usize,
    scale: f32,
    inv: f32,
    out: &mut [f32],
) {
    gather(src, offsets, row_len, |b| refined(b, scale, inv), out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(src: &[u8], offsets: &[i64], row_len: usize, scale: f32, inv: f32, out: &mut [f32]) {
    gather(src, offsets, row_len, |b| refined(b, scale, inv), out);
}
