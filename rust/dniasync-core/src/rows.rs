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
    if row_len > 0 {
        let rows: Vec<(&[u8], usize)> = offsets.iter().map(|&o| (src, o as usize)).collect();
        convert_rows(&rows, row_len, scale, out);
    }
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

/// Where the rows of a shuffled shard lie: positions from `bounds[j]` (ascending) up to the next
/// bound are consecutive rows of file `file[j]` (-1: none; such positions, and those before
/// `bounds[0]`, are not served here), position `p`'s features at byte `x[j] + p * row_len` and
/// its int64 label at byte `y[j] + 8 * p`. A last entry with file -1 closes the range.
pub struct Blocks<'a> {
    pub bounds: &'a [i64],
    pub file: &'a [i64],
    pub x: &'a [i64],
    pub y: &'a [i64],
}

/// A batch of a shard read straight from its files' mappings (`srcs[f]`: file `f`'s bytes, None
/// where not mapped): the features of `positions` into `out_x` (uint8 divided by `scale`, as
/// `gather_u8_scaled` computes them) and their labels into `out_y`. Ok(false), with the outputs
/// unspecified, where a position is outside the blocks or in a block with no file (the caller
/// then takes its general path); InvalidArgument where a row lies outside its file.
pub fn gather_blocks_u8(
    srcs: &[Option<&[u8]>],
    blocks: &Blocks<'_>,
    positions: &[i64],
    row_len: usize,
    scale: f32,
    out_x: &mut [f32],
    out_y: &mut [i64],
) -> Result<bool> {
    check_len("output batch", positions.len() * row_len, out_x.len())?;
    check_len("output labels", positions.len(), out_y.len())?;
    let n = blocks.file.len();
    if blocks.bounds.len() != n || blocks.x.len() != n || blocks.y.len() != n {
        return Err(invalid(
            "blocks: bounds, file, x and y must be as long as each other",
        ));
    }
    let mut rows: Vec<(&[u8], usize)> = Vec::with_capacity(positions.len());
    for (i, &p) in positions.iter().enumerate() {
        let j = blocks.bounds.partition_point(|&b| b <= p);
        if j == 0 {
            return Ok(false);
        }
        let j = j - 1;
        let Some(Some(src)) = usize::try_from(blocks.file[j])
            .ok()
            .and_then(|f| srcs.get(f))
        else {
            return Ok(false);
        };
        let row_len_i = row_len as i64;
        let (xo, yo) = (blocks.x[j] + p * row_len_i, blocks.y[j] + 8 * p);
        let fits = |o: i64, len: usize| {
            usize::try_from(o)
                .ok()
                .and_then(|s| s.checked_add(len))
                .is_some_and(|e| e <= src.len())
        };
        if !fits(xo, row_len) || !fits(yo, 8) {
            return Err(invalid(format!(
                "position {p}: its row lies outside its file's {} bytes",
                src.len()
            )));
        }
        let yo = yo as usize;
        out_y[i] = i64::from_le_bytes(src[yo..yo + 8].try_into().expect("8 bytes"));
        rows.push((src, xo as usize));
    }
    if !(scale.is_finite() && scale != 0.0) {
        return Err(invalid(format!(
            "scale must be finite and not 0, got {scale}"
        )));
    }
    if row_len > 0 {
        convert_rows(&rows, row_len, scale, out_x);
    }
    Ok(true)
}

fn convert_rows(rows: &[(&[u8], usize)], row_len: usize, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let inv = 1.0 / scale;
        match isa() {
            // SAFETY: `isa()` never exceeds what the CPU was detected to have.
            Isa::Avx512 if refined_is_exact(scale, inv) => {
                return unsafe { rows_avx512(rows, row_len, scale, inv, out) }
            }
            Isa::Avx2 if refined_is_exact(scale, inv) => {
                return unsafe { rows_avx2(rows, row_len, scale, inv, out) }
            }
            _ => {}
        }
    }
    each_row(rows, row_len, |b| f32::from(b) / scale, out);
}

#[inline(always)]
fn each_row(rows: &[(&[u8], usize)], row_len: usize, value: impl Fn(u8) -> f32, out: &mut [f32]) {
    for (dst, &(src, start)) in out.chunks_exact_mut(row_len).zip(rows) {
        for (d, &s) in dst.iter_mut().zip(&src[start..start + row_len]) {
            *d = value(s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn rows_avx512(
    rows: &[(&[u8], usize)],
    row_len: usize,
    scale: f32,
    inv: f32,
    out: &mut [f32],
) {
    each_row(rows, row_len, |b| refined(b, scale, inv), out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(
    rows: &[(&[u8], usize)],
    row_len: usize,
    scale: f32,
    inv: f32,
    out: &mut [f32],
) {
    each_row(rows, row_len, |b| refined(b, scale, inv), out);
}
