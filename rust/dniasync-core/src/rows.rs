//! Rows of a memory-mapped data file gathered into a float32 batch in one pass.
//!
//! A converted data set stores features as uint8 (a quarter of float32's bytes on disk and in
//! the page cache); a trainer wants float32 divided by the set's scale. Gathering the rows and
//! converting them in one pass writes each output value once and reads each source byte once,
//! straight from the mapping: a page a row lies on is faulted in here, with the interpreter
//! released. The division is `f32` division, so the values are bit for bit numpy's
//! `np.divide(x, np.float32(scale), dtype=np.float32)`.
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
    match isa() {
        // SAFETY: `isa()` never exceeds what the CPU was detected to have.
        Isa::Avx512 => return unsafe { avx512(src, offsets, row_len, scale, out) },
        Isa::Avx2 => return unsafe { avx2(src, offsets, row_len, scale, out) },
        Isa::Base => {}
    }
    gather(src, offsets, row_len, scale, out);
    Ok(())
}

#[inline(always)]
fn gather(src: &[u8], offsets: &[i64], row_len: usize, scale: f32, out: &mut [f32]) {
    for (row, &o) in out.chunks_exact_mut(row_len).zip(offsets) {
        let start = o as usize; // checked by the caller
        for (d, &s) in row.iter_mut().zip(&src[start..start + row_len]) {
            *d = f32::from(s) / scale;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn avx512(
    src: &[u8],
    offsets: &[i64],
    row_len: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    gather(src, offsets, row_len, scale, out);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2(
    src: &[u8],
    offsets: &[i64],
    row_len: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    gather(src, offsets, row_len, scale, out);
    Ok(())
}
