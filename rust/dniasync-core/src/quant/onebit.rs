//! 1-bit SGD with error feedback (Seide et al. 2014), per block instead of per column.
//!
//! The encoder adds the gradient to its carried error, then per block of `block`
//! elements sends one bit per element (1 = value >= 0) and two reconstruction values:
//! the mean of the values with bit 1 and the mean of those with bit 0. What the
//! reconstruction misses becomes the carried error for the next step.
//!
//! Payload (little endian): `n_blocks` pairs of f32 `(mean_nonneg, mean_neg)`, then
//! `ceil(n / 8)` bytes of bits, element `i` at bit `i % 8` of byte `i / 8`.
use crate::error::{check_len, invalid, CoreError, Result};
use crate::grad::GradSource;
use crate::quant::{read_f32s, Codec};
use crate::simd::lanes::{sum16, Lanes, Wide, VIRTUAL_LANES};
use crate::simd::{self, by_isa};

/// Default block: 256 elements cost 8 bytes of reconstruction values, 25.6x overall.
pub const DEFAULT_BLOCK: usize = 256;

fn check_block(block: usize) -> Result<()> {
    if block > 0 && block.is_multiple_of(8) {
        Ok(())
    } else {
        Err(invalid(format!(
            "block must be a positive multiple of 8, got {block}"
        )))
    }
}

/// Payload bytes for `n` elements.
pub fn payload_len(n: usize, block: usize) -> usize {
    n.div_ceil(block) * 8 + n.div_ceil(8)
}

/// Dense size over payload size.
pub fn compression_ratio(n: usize, block: usize) -> f64 {
    (4 * n) as f64 / payload_len(n, block).max(1) as f64
}

/// 1-bit codec for vectors of `n` elements; payloads are bytes.
#[derive(Clone, Copy, Debug)]
pub struct OneBitCodec {
    n: usize,
    block: usize,
}

impl OneBitCodec {
    pub fn new(n: usize, block: usize) -> Result<Self> {
        check_block(block)?;
        Ok(OneBitCodec { n, block })
    }

    pub fn block(&self) -> usize {
        self.block
    }
}

impl Codec for OneBitCodec {
    type Code = u8;
    type Encoder = OneBitEncoder;
    type Grad<'a> = OneBitGrad<'a>;

    fn n(&self) -> usize {
        self.n
    }

    fn encoder(&self) -> OneBitEncoder {
        OneBitEncoder {
            block: self.block,
            error: vec![0.0; self.n],
        }
    }

    fn encode(&self, encoder: &mut OneBitEncoder, grad: &[f32], out: &mut Vec<u8>) -> Result<()> {
        encoder.encode(grad, out)
    }

    fn carried<'e>(&self, encoder: &'e OneBitEncoder) -> &'e [f32] {
        encoder.error()
    }

    fn reset(&self, encoder: &mut OneBitEncoder) {
        encoder.reset();
    }

    fn decode(&self, payload: &[u8], out: &mut [f32]) -> Result<()> {
        check_len("output buffer", self.n, out.len())?;
        decode(payload, self.block, out)
    }

    fn grad<'a>(&'a self, payload: &'a [u8]) -> Result<OneBitGrad<'a>> {
        OneBitGrad::new(payload, self.n, self.block)
    }
}

/// Sender state: the block size and the error carried between steps.
pub struct OneBitEncoder {
    block: usize,
    error: Vec<f32>,
}

impl OneBitEncoder {
    pub fn new(n: usize, block: usize) -> Result<Self> {
        Ok(OneBitCodec::new(n, block)?.encoder())
    }

    pub fn block(&self) -> usize {
        self.block
    }

    pub fn len(&self) -> usize {
        self.error.len()
    }

    pub fn is_empty(&self) -> bool {
        self.error.is_empty()
    }

    /// The quantization error carried to the next step.
    pub fn error(&self) -> &[f32] {
        &self.error
    }

    pub fn reset(&mut self) {
        self.error.fill(0.0);
    }

    /// Encodes `grad + error` into `out` (resized) and keeps the new error.
    /// A gradient with NaN/Inf is rejected before anything changes.
    pub fn encode(&mut self, grad: &[f32], out: &mut Vec<u8>) -> Result<()> {
        check_len("gradient", self.error.len(), grad.len())?;
        if !simd::all_finite(grad) {
            return Err(CoreError::NonFinite { what: "gradient" });
        }
        let n = grad.len();
        out.clear();
        out.resize(payload_len(n, self.block), 0);
        let (recon, bits) = out.split_at_mut(n.div_ceil(self.block) * 8);
        encode_kernel(&mut self.error, grad, self.block, recon, bits);
        Ok(())
    }
}

by_isa! {
    fn encode_kernel(err: &mut [f32], g: &[f32], block: usize, recon: &mut [u8], bits: &mut [u8]) {
        lanes L => encode_lanes::<L>(err, g, block, recon, bits),
        // SAFETY: portable lanes need no CPU feature.
        base => unsafe { encode_lanes::<Wide>(err, g, block, recon, bits) },
    }
}

/// Encodes block by block (`bits` zeroed, `block` a multiple of 8): two passes over each
/// block while it sits in L1, one for the means and one for the bits and the new error.
#[inline(always)]
unsafe fn encode_lanes<L: Lanes>(
    err: &mut [f32],
    g: &[f32],
    block: usize,
    recon: &mut [u8],
    bits: &mut [u8],
) {
    assert!(err.len() == g.len() && bits.len() == g.len().div_ceil(8));
    assert!(block.is_multiple_of(8) && recon.len() == 8 * g.len().div_ceil(block));
    for (b, (ec, gc)) in err.chunks_mut(block).zip(g.chunks(block)).enumerate() {
        let (pos, neg) = block_means::<L>(ec, gc);
        recon[8 * b..8 * b + 4].copy_from_slice(&pos.to_le_bytes());
        recon[8 * b + 4..8 * b + 8].copy_from_slice(&neg.to_le_bytes());
        // SAFETY: the block's bits start at byte `b * block / 8` and fill `ec.len() / 8` bytes
        // (rounded up), all within `bits`.
        quantize_block::<L>(ec, pos, neg, bits.as_mut_ptr().add(b * block / 8));
    }
}

/// Adds `g` into `acc` and returns (mean of the values >= 0, mean of those < 0). Element
/// `i` goes into partial sum `i % 16` whatever the lane width, and the partial sums are
/// added up in one order, so every ISA gives the same means.
#[inline(always)]
unsafe fn block_means<L: Lanes>(acc: &mut [f32], g: &[f32]) -> (f32, f32) {
    const V: usize = VIRTUAL_LANES;
    let per = V / L::N;
    let len = acc.len();
    let full = len - len % V;
    let zero = L::splat(0.0);
    let (mut total, mut nonneg) = ([zero; V], [zero; V]);
    let mut count = 0u32;
    let (ap, gp) = (acc.as_mut_ptr(), g.as_ptr());
    let mut i = 0;
    while i < full {
        for k in 0..per {
            // SAFETY: `i + V <= full <= len`.
            let p = i + k * L::N;
            let a = L::load(ap.add(p)).add(L::load(gp.add(p)));
            a.store(ap.add(p));
            let nonneg_lanes = a.ge(zero);
            total[k] = total[k].add(a);
            nonneg[k] = nonneg[k].add(L::select(nonneg_lanes, a, zero));
            count += L::bits(nonneg_lanes).count_ones();
        }
        i += V;
    }
    let (mut t, mut s) = ([0f32; V], [0f32; V]);
    for k in 0..per {
        total[k].spill(&mut t[k * L::N..]);
        nonneg[k].spill(&mut s[k * L::N..]);
    }
    for j in full..len {
        let a = acc[j] + g[j];
        acc[j] = a;
        t[j % V] += a;
        s[j % V] += if a >= 0.0 { a } else { 0.0 };
        count += u32::from(a >= 0.0);
    }
    let (total, sum_pos, n_pos) = (sum16(t), sum16(s), count as f32);
    let n_neg = len as f32 - n_pos;
    let pos = if n_pos > 0.0 { sum_pos / n_pos } else { 0.0 };
    let neg = if n_neg > 0.0 {
        (total - sum_pos) / n_neg
    } else {
        0.0
    };
    (pos, neg)
}

/// Writes one bit per element of `acc` (1 = value >= 0) at `bits` (zeroed) and leaves in
/// `acc` what the reconstruction `pos` / `neg` misses.
#[inline(always)]
unsafe fn quantize_block<L: Lanes>(acc: &mut [f32], pos: f32, neg: f32, bits: *mut u8) {
    let len = acc.len();
    let wide = len - len % L::N;
    let (pv, nv, zero) = (L::splat(pos), L::splat(neg), L::splat(0.0));
    let ap = acc.as_mut_ptr();
    let mut i = 0;
    while i < wide {
        // SAFETY: `i + L::N <= len`; whole bytes, as `L::N` and `i` are multiples of 8.
        let a = L::load(ap.add(i));
        let nonneg = a.ge(zero);
        a.sub(L::select(nonneg, pv, nv)).store(ap.add(i));
        let mask = L::bits(nonneg).to_le_bytes();
        std::ptr::copy_nonoverlapping(mask.as_ptr(), bits.add(i / 8), L::N / 8);
        i += L::N;
    }
    for (j, a) in acc.iter_mut().enumerate().skip(wide) {
        let nonneg = *a >= 0.0;
        *a -= if nonneg { pos } else { neg };
        *bits.add(j / 8) |= u8::from(nonneg) << (j % 8);
    }
}

/// A parsed payload; also a `GradSource` decoding on the fly.
pub struct OneBitGrad<'a> {
    recon: Vec<f32>,
    bits: &'a [u8],
    block: usize,
    n: usize,
}

impl<'a> OneBitGrad<'a> {
    pub fn new(payload: &'a [u8], n: usize, block: usize) -> Result<Self> {
        check_block(block)?;
        check_len("1-bit payload bytes", payload_len(n, block), payload.len())?;
        let (recon, bits) = payload.split_at(n.div_ceil(block) * 8);
        Ok(OneBitGrad {
            recon: read_f32s(recon),
            bits,
            block,
            n,
        })
    }

    #[inline(always)]
    fn value(&self, i: usize) -> f32 {
        let bit = (self.bits[i >> 3] >> (i & 7)) & 1;
        self.recon[2 * (i / self.block) + usize::from(bit == 0)]
    }
}

impl GradSource for OneBitGrad<'_> {
    fn len(&self) -> usize {
        self.n
    }

    fn chunk<'b>(&'b mut self, start: usize, buf: &'b mut [f32]) -> &'b [f32] {
        let mut i = start;
        let end = start + buf.len();
        while i < end {
            let b = i / self.block;
            let (pos, neg) = (self.recon[2 * b], self.recon[2 * b + 1]);
            let stop = ((b + 1) * self.block).min(end);
            for (k, slot) in buf[i - start..stop - start].iter_mut().enumerate() {
                let j = i + k;
                *slot = if (self.bits[j >> 3] >> (j & 7)) & 1 != 0 {
                    pos
                } else {
                    neg
                };
            }
            i = stop;
        }
        buf
    }

    fn norm_sq(&self) -> f64 {
        let mut total = 0f64;
        for b in 0..self.recon.len() / 2 {
            let start = b * self.block;
            let len = self.block.min(self.n - start);
            let ones: usize = (start..start + len)
                .filter(|&i| (self.bits[i >> 3] >> (i & 7)) & 1 != 0)
                .count();
            let (p, q) = (
                f64::from(self.recon[2 * b]),
                f64::from(self.recon[2 * b + 1]),
            );
            total += ones as f64 * p * p + (len - ones) as f64 * q * q;
        }
        total
    }

    fn all_finite(&self) -> bool {
        self.recon.iter().all(|v| v.is_finite())
    }
}

/// Dense decode of `payload` into `out`.
pub fn decode(payload: &[u8], block: usize, out: &mut [f32]) -> Result<()> {
    let grad = OneBitGrad::new(payload, out.len(), block)?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = grad.value(i);
    }
    Ok(())
}
