//! 8-bit blockwise quantization: per block of `block` elements one f32 scale
//! (`max |g| / 127`) and one signed byte per element (`round(g / scale)`).
//! Stateless; each element is off by at most half its block's scale.
//!
//! Payload (little endian): `n_blocks` f32 scales, then `n` i8 codes.
use crate::error::{check_len, invalid, CoreError, Result};
use crate::grad::GradSource;
use crate::quant::{read_f32s, Codec};
use crate::simd::by_isa;
use crate::simd::lanes::{Lanes, Wide};
use std::mem::MaybeUninit;

/// Default block: 256 elements share a 4-byte scale, 3.94x overall.
pub const DEFAULT_BLOCK: usize = 256;

fn check_block(block: usize) -> Result<()> {
    if block > 0 {
        Ok(())
    } else {
        Err(invalid("block must be positive"))
    }
}

/// Payload bytes for `n` elements.
pub fn payload_len(n: usize, block: usize) -> usize {
    n.div_ceil(block) * 4 + n
}

/// Dense size over payload size.
pub fn compression_ratio(n: usize, block: usize) -> f64 {
    (4 * n) as f64 / payload_len(n, block).max(1) as f64
}

/// 8-bit codec for vectors of `n` elements; payloads are bytes. Stateless: nothing is
/// carried between encodes.
#[derive(Clone, Copy, Debug)]
pub struct Int8Codec {
    n: usize,
    block: usize,
}

impl Int8Codec {
    pub fn new(n: usize, block: usize) -> Result<Self> {
        check_block(block)?;
        Ok(Int8Codec { n, block })
    }

    pub fn block(&self) -> usize {
        self.block
    }
}

impl Codec for Int8Codec {
    type Code = u8;
    type Encoder = ();
    type Grad<'a> = Int8Grad<'a>;

    fn n(&self) -> usize {
        self.n
    }

    fn encoder(&self) {}

    fn encode(&self, _encoder: &mut (), grad: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_len("gradient", self.n, grad.len())?;
        encode(grad, self.block, out)
    }

    fn carried<'e>(&self, _encoder: &'e ()) -> &'e [f32] {
        &[]
    }

    fn reset(&self, _encoder: &mut ()) {}

    fn decode(&self, payload: &[u8], out: &mut [f32]) -> Result<()> {
        check_len("output buffer", self.n, out.len())?;
        decode(payload, self.block, out)
    }

    fn grad<'a>(&'a self, payload: &'a [u8]) -> Result<Int8Grad<'a>> {
        Int8Grad::new(payload, self.n, self.block)
    }
}

/// Encodes `grad` into `out` (resized). Rejects NaN/Inf (then `out` is left empty).
pub fn encode(grad: &[f32], block: usize, out: &mut Vec<u8>) -> Result<()> {
    check_block(block)?;
    out.clear();
    let total = payload_len(grad.len(), block);
    out.reserve(total);
    let (scales, codes) =
        out.spare_capacity_mut()[..total].split_at_mut(grad.len().div_ceil(block) * 4);
    // The finiteness check rides along the pass that finds each block's scale: no dense
    // state changes here, so a gradient found bad halfway loses nothing.
    if !encode_kernel(grad, block, scales, codes) {
        return Err(CoreError::NonFinite { what: "gradient" });
    }
    // SAFETY: the kernel wrote every one of the `total` bytes (a scale per block, a code per element).
    unsafe { out.set_len(total) };
    Ok(())
}

by_isa! {
    fn encode_kernel(g: &[f32], block: usize, scales: &mut [MaybeUninit<u8>], codes: &mut [MaybeUninit<u8>]) -> bool {
        lanes L => encode_lanes::<L>(g, block, scales, codes),
        // SAFETY: portable lanes need no CPU feature.
        base => unsafe { encode_lanes::<Wide>(g, block, scales, codes) },
    }
}

/// Writes each block's scale and codes; false (stopping there) when an element is NaN/Inf.
#[inline(always)]
unsafe fn encode_lanes<L: Lanes>(
    g: &[f32],
    block: usize,
    scales: &mut [MaybeUninit<u8>],
    codes: &mut [MaybeUninit<u8>],
) -> bool {
    assert!(scales.len() == 4 * g.len().div_ceil(block) && codes.len() == g.len());
    for (b, (gc, cc)) in g.chunks(block).zip(codes.chunks_mut(block)).enumerate() {
        let Some(m) = max_abs::<L>(gc) else {
            return false;
        };
        let scale = m / 127.0;
        let inv = if m > 0.0 { 127.0 / m } else { 0.0 };
        for (d, s) in scales[4 * b..4 * b + 4].iter_mut().zip(scale.to_le_bytes()) {
            d.write(s);
        }
        let out = cc.as_mut_ptr().cast::<u8>();
        if inv.is_finite() {
            quantize::<L>(gc, inv, out);
        } else {
            // A block of tiny subnormals: `g * inv` overflows, the clamp catches it.
            for (j, &v) in gc.iter().enumerate() {
                *out.add(j) = ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8;
            }
        }
    }
    true
}

/// Largest `|x|` in `x`, or None when some element is NaN or Inf.
#[inline(always)]
unsafe fn max_abs<L: Lanes>(x: &[f32]) -> Option<f32> {
    let wide = x.len() - x.len() % L::N;
    let p = x.as_ptr();
    // Compared as integers, the largest |x| is also the one that tells NaN/Inf apart.
    let mut max = L::splat(0.0);
    let mut i = 0;
    while i < wide {
        // SAFETY: `i + L::N <= x.len()`.
        max = L::load(p.add(i)).max_abs_bits(max);
        i += L::N;
    }
    let mut lanes = [0f32; 16];
    max.spill(&mut lanes);
    let mut m = lanes[..L::N].iter().fold(0f32, |m, &v| m.max_abs_bits(v));
    for &v in &x[wide..] {
        m = v.max_abs_bits(m);
    }
    m.is_finite().then_some(m)
}

/// `round(v * inv)` (half away from zero) as a signed byte per element, at `out`. With
/// `|v * inv| <= 127.0001` (inv from the block's max), `trunc(y + copysign(0.5 - ulp/2, y))`
/// is exactly that rounding, and no clamp is needed.
#[inline(always)]
unsafe fn quantize<L: Lanes>(g: &[f32], inv: f32, out: *mut u8) {
    let (iv, hv) = (L::splat(inv), L::splat(HALF_DOWN));
    let p = g.as_ptr();
    let mut i = 0;
    // SAFETY (all loops): `i + 4 L::N` (or `L::N`, 1) `<= g.len()`; `out` holds `g.len()` bytes.
    while i + 4 * L::N <= g.len() {
        let mut regs = [iv; 4];
        for (k, r) in regs.iter_mut().enumerate() {
            *r = to_trunc(L::load(p.add(i + k * L::N)), iv, hv);
        }
        L::store_i8x4(regs, out.add(i));
        i += 4 * L::N;
    }
    while i + L::N <= g.len() {
        to_trunc(L::load(p.add(i)), iv, hv).store_i8(out.add(i));
        i += L::N;
    }
    while i < g.len() {
        to_trunc(*p.add(i), inv, HALF_DOWN).store_i8(out.add(i));
        i += 1;
    }
}

/// The float below 0.5: adding it (signed) then truncating rounds half away from zero.
const HALF_DOWN: f32 = 0.499_999_97;
const _: () = assert!(HALF_DOWN.to_bits() == 0.5f32.to_bits() - 1);

/// `v * inv` moved so that truncating it rounds it (see `quantize`).
#[inline(always)]
unsafe fn to_trunc<L: Lanes>(v: L, inv: L, half_down: L) -> L {
    let y = v.mul(inv);
    y.add(half_down.copysign(y))
}

/// A parsed payload; also a `GradSource` decoding on the fly.
pub struct Int8Grad<'a> {
    scales: Vec<f32>,
    codes: &'a [u8],
    block: usize,
}

impl<'a> Int8Grad<'a> {
    pub fn new(payload: &'a [u8], n: usize, block: usize) -> Result<Self> {
        check_block(block)?;
        check_len("8-bit payload bytes", payload_len(n, block), payload.len())?;
        let (scales, codes) = payload.split_at(n.div_ceil(block) * 4);
        Ok(Int8Grad {
            scales: read_f32s(scales),
            codes,
            block,
        })
    }
}

impl GradSource for Int8Grad<'_> {
    fn len(&self) -> usize {
        self.codes.len()
    }

    fn chunk<'b>(&'b mut self, start: usize, buf: &'b mut [f32]) -> &'b [f32] {
        let mut i = start;
        let end = start + buf.len();
        while i < end {
            let b = i / self.block;
            let scale = self.scales[b];
            let stop = ((b + 1) * self.block).min(end);
            for (slot, &c) in buf[i - start..stop - start]
                .iter_mut()
                .zip(&self.codes[i..stop])
            {
                *slot = f32::from(c as i8) * scale;
            }
            i = stop;
        }
        buf
    }

    fn norm_sq(&self) -> f64 {
        self.codes
            .chunks(self.block)
            .zip(&self.scales)
            .map(|(c, &s)| {
                let q: i64 = c.iter().map(|&x| i64::from(x as i8).pow(2)).sum();
                q as f64 * f64::from(s) * f64::from(s)
            })
            .sum()
    }

    fn all_finite(&self) -> bool {
        self.scales.iter().all(|v| v.is_finite())
    }
}

/// Dense decode of `payload` into `out`.
pub fn decode(payload: &[u8], block: usize, out: &mut [f32]) -> Result<()> {
    let mut grad = Int8Grad::new(payload, out.len(), block)?;
    let n = out.len();
    let mut start = 0;
    while start < n {
        let len = (n - start).min(crate::simd::CHUNK);
        let mut buf = [0f32; crate::simd::CHUNK];
        let vals = grad.chunk(start, &mut buf[..len]);
        out[start..start + len].copy_from_slice(vals);
        start += len;
    }
    Ok(())
}
