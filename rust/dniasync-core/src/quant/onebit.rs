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
use crate::simd::{self, multiversion};

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
        #[cfg(target_arch = "x86_64")]
        if simd::isa() == simd::Isa::Avx512 && self.block.is_multiple_of(16) {
            // SAFETY: the CPU has AVX-512F.
            unsafe { encode_avx512(&mut self.error, grad, self.block, recon, bits) };
            return Ok(());
        }
        encode_kernel(&mut self.error, grad, self.block, recon, bits);
        Ok(())
    }
}

multiversion! {
    fn encode_kernel(err: &mut [f32], g: &[f32], block: usize, recon: &mut [u8], bits: &mut [u8]) {
        for (b, (ec, gc)) in err.chunks_mut(block).zip(g.chunks(block)).enumerate() {
            let (pos, neg) = block_means(ec, gc);
            recon[8 * b..8 * b + 4].copy_from_slice(&pos.to_le_bytes());
            recon[8 * b + 4..8 * b + 8].copy_from_slice(&neg.to_le_bytes());
            let out = &mut bits[b * block / 8..];
            for (bytes, acc) in out.chunks_mut(8).zip(ec.chunks_mut(64)) {
                // Flags and error update vectorise; the flags then pack into one u64.
                let mut flags = [0u8; 64];
                for (a, f) in acc.iter_mut().zip(flags.iter_mut()) {
                    let nonneg = *a >= 0.0;
                    *f = u8::from(nonneg);
                    *a -= if nonneg { pos } else { neg };
                }
                let mut mask = 0u64;
                for (j, &f) in flags.iter().enumerate() {
                    mask |= u64::from(f) << j;
                }
                let n_bytes = acc.len().div_ceil(8);
                bytes[..n_bytes].copy_from_slice(&mask.to_le_bytes()[..n_bytes]);
            }
        }
    }
}

/// `encode_kernel` with AVX-512: compares give the sign bits as masks, masked adds the sums.
/// Requires `block % 16 == 0`; the last block may be shorter (its tail is done in scalar).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn encode_avx512(
    err: &mut [f32],
    g: &[f32],
    block: usize,
    recon: &mut [u8],
    bits: &mut [u8],
) {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_cmp_ps_mask, _mm512_loadu_ps, _mm512_mask_add_ps,
        _mm512_mask_blend_ps, _mm512_reduce_add_ps, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_storeu_ps, _mm512_sub_ps, _CMP_GE_OQ,
    };
    let zero = _mm512_setzero_ps();
    for (b, (ec, gc)) in err.chunks_mut(block).zip(g.chunks(block)).enumerate() {
        let len = ec.len();
        let wide = len & !15;
        let (ep, gp) = (ec.as_mut_ptr(), gc.as_ptr());
        let (mut total, mut nonneg) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut count = 0u32;
        let mut i = 0;
        while i < wide {
            // SAFETY: i + 16 <= wide <= len, within both block slices.
            let a = _mm512_add_ps(_mm512_loadu_ps(ep.add(i)), _mm512_loadu_ps(gp.add(i)));
            _mm512_storeu_ps(ep.add(i), a);
            let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, zero);
            total = _mm512_add_ps(total, a);
            nonneg = _mm512_mask_add_ps(nonneg, m, nonneg, a);
            count += m.count_ones();
            i += 16;
        }
        let (mut total, mut sum_pos, mut n_pos) = (
            _mm512_reduce_add_ps(total),
            _mm512_reduce_add_ps(nonneg),
            count as f32,
        );
        for j in wide..len {
            ec[j] += gc[j];
            total += ec[j];
            if ec[j] >= 0.0 {
                sum_pos += ec[j];
                n_pos += 1.0;
            }
        }
        let n_neg = len as f32 - n_pos;
        let pos = if n_pos > 0.0 { sum_pos / n_pos } else { 0.0 };
        let neg = if n_neg > 0.0 {
            (total - sum_pos) / n_neg
        } else {
            0.0
        };
        recon[8 * b..8 * b + 4].copy_from_slice(&pos.to_le_bytes());
        recon[8 * b + 4..8 * b + 8].copy_from_slice(&neg.to_le_bytes());
        let (pv, nv) = (_mm512_set1_ps(pos), _mm512_set1_ps(neg));
        let out = &mut bits[b * block / 8..];
        let mut i = 0;
        while i < wide {
            let a = _mm512_loadu_ps(ep.add(i));
            let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, zero);
            _mm512_storeu_ps(ep.add(i), _mm512_sub_ps(a, _mm512_mask_blend_ps(m, nv, pv)));
            out[i / 8..i / 8 + 2].copy_from_slice(&m.to_le_bytes());
            i += 16;
        }
        for j in wide..len {
            let nonneg = ec[j] >= 0.0;
            ec[j] -= if nonneg { pos } else { neg };
            out[j / 8] |= u8::from(nonneg) << (j % 8);
        }
    }
}

/// Adds `g` into `acc` and returns (mean of values >= 0, mean of values < 0).
#[inline(always)]
fn block_means(acc: &mut [f32], g: &[f32]) -> (f32, f32) {
    let (mut total, mut nonneg, mut count) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    let mut ac = acc.chunks_exact_mut(8);
    let mut gcs = g.chunks_exact(8);
    for (a8, g8) in (&mut ac).zip(&mut gcs) {
        for j in 0..8 {
            let a = a8[j] + g8[j];
            a8[j] = a;
            let keep = a >= 0.0;
            total[j] += a;
            nonneg[j] += if keep { a } else { 0.0 };
            count[j] += if keep { 1.0 } else { 0.0 };
        }
    }
    for (a, &x) in ac.into_remainder().iter_mut().zip(gcs.remainder()) {
        *a += x;
        total[0] += *a;
        if *a >= 0.0 {
            nonneg[0] += *a;
            count[0] += 1.0;
        }
    }
    let total: f32 = total.iter().sum();
    let sum_pos: f32 = nonneg.iter().sum();
    let n_pos: f32 = count.iter().sum();
    let n_neg = acc.len() as f32 - n_pos;
    let pos = if n_pos > 0.0 { sum_pos / n_pos } else { 0.0 };
    let neg = if n_neg > 0.0 {
        (total - sum_pos) / n_neg
    } else {
        0.0
    };
    (pos, neg)
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
