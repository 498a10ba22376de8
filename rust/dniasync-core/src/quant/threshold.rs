//! Strom (2015) threshold quantization with a sender-side residual.
//!
//! Semantics: the encoder adds the gradient to its residual; every element whose
//! residual reaches `+tau` or `-tau` is emitted once as a 32-bit code (bit 31 = sign,
//! bits 0..31 = index, indices ascending) and `±tau` is subtracted from the residual.
//! Decoding yields exactly `±tau` at each coded index (not ±1 as in some
//! implementations) and zero elsewhere, so `decode(encode(g)) + new residual ==
//! g + old residual` up to one f32 rounding.
use crate::error::{check_len, invalid, CoreError, Result};
use crate::grad::GradSource;
use crate::optim::SIGN_BIT;
use crate::quant::Codec;
use crate::simd::{self, multiversion};

/// Largest vector the 31-bit index can address.
pub const MAX_LEN: usize = 1 << 31;

/// Threshold codec for vectors of `n` elements; payloads are `u32` codes.
#[derive(Clone, Copy, Debug)]
pub struct ThresholdCodec {
    n: usize,
    tau: f32,
}

impl ThresholdCodec {
    pub fn new(n: usize, tau: f32) -> Result<Self> {
        check_tau(tau)?;
        if n > MAX_LEN {
            return Err(invalid(format!(
                "threshold codes address at most 2^31 elements, got {n}"
            )));
        }
        Ok(ThresholdCodec { n, tau })
    }

    pub fn tau(&self) -> f32 {
        self.tau
    }
}

impl Codec for ThresholdCodec {
    type Code = u32;
    type Encoder = ThresholdEncoder;
    type Grad<'a> = ThresholdGrad<'a>;

    fn n(&self) -> usize {
        self.n
    }

    fn encoder(&self) -> ThresholdEncoder {
        ThresholdEncoder {
            tau: self.tau,
            residual: vec![0.0; self.n],
        }
    }

    fn encode(
        &self,
        encoder: &mut ThresholdEncoder,
        grad: &[f32],
        out: &mut Vec<u32>,
    ) -> Result<()> {
        encoder.encode(grad, out)
    }

    fn carried<'e>(&self, encoder: &'e ThresholdEncoder) -> &'e [f32] {
        encoder.residual()
    }

    fn reset(&self, encoder: &mut ThresholdEncoder) {
        encoder.reset();
    }

    fn decode(&self, codes: &[u32], out: &mut [f32]) -> Result<()> {
        check_len("output buffer", self.n, out.len())?;
        decode(codes, self.tau, out)
    }

    fn grad<'a>(&'a self, codes: &'a [u32]) -> Result<ThresholdGrad<'a>> {
        ThresholdGrad::new(codes, self.tau, self.n)
    }

    /// Only the coded elements change.
    fn touched(&self, codes: &[u32]) -> usize {
        codes.len()
    }
}

/// Sender state: the threshold and the residual carried between steps.
pub struct ThresholdEncoder {
    tau: f32,
    residual: Vec<f32>,
}

impl ThresholdEncoder {
    pub fn new(n: usize, tau: f32) -> Result<Self> {
        Ok(ThresholdCodec::new(n, tau)?.encoder())
    }

    pub fn tau(&self) -> f32 {
        self.tau
    }

    pub fn len(&self) -> usize {
        self.residual.len()
    }

    pub fn is_empty(&self) -> bool {
        self.residual.is_empty()
    }

    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Zeroes the residual.
    pub fn reset(&mut self) {
        self.residual.fill(0.0);
    }

    /// Adds `grad` to the residual and appends the codes to `out` (cleared first).
    /// A gradient with NaN/Inf is rejected before anything changes.
    pub fn encode(&mut self, grad: &[f32], out: &mut Vec<u32>) -> Result<()> {
        check_len("gradient", self.residual.len(), grad.len())?;
        if !simd::all_finite(grad) {
            return Err(CoreError::NonFinite { what: "gradient" });
        }
        out.clear();
        #[cfg(target_arch = "x86_64")]
        if simd::isa() == simd::Isa::Avx512 {
            // SAFETY: the CPU has AVX-512F.
            unsafe { encode_avx512(&mut self.residual, grad, self.tau, out) };
            return Ok(());
        }
        encode_kernel(&mut self.residual, grad, self.tau, out);
        Ok(())
    }
}

fn check_tau(tau: f32) -> Result<()> {
    if tau > 0.0 && tau.is_finite() {
        Ok(())
    } else {
        Err(invalid(format!(
            "tau must be positive and finite, got {tau}"
        )))
    }
}

multiversion! {
    fn encode_kernel(r: &mut [f32], g: &[f32], tau: f32, out: &mut Vec<u32>) {
        const B: usize = 64;
        let base_len = r.len() - r.len() % B;
        let (rh, rt) = r.split_at_mut(base_len);
        let (gh, gt) = g.split_at(base_len);
        for (bi, (rc, gc)) in rh.chunks_exact_mut(B).zip(gh.chunks_exact(B)).enumerate() {
            // Vectorised pass: accumulate and flag the elements that crossed the threshold.
            let mut flags = [0u8; B];
            for ((ri, &gi), f) in rc.iter_mut().zip(gc).zip(flags.iter_mut()) {
                *ri += gi;
                *f = u8::from(ri.abs() >= tau);
            }
            let mut mask = 0u64;
            for (j, &f) in flags.iter().enumerate() {
                mask |= u64::from(f) << j;
            }
            // Visit only the flagged elements.
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                mask &= mask - 1;
                emit_one(&mut rc[j], bi * B + j, tau, out);
            }
        }
        for (j, (ri, &gi)) in rt.iter_mut().zip(gt).enumerate() {
            *ri += gi;
            if ri.abs() >= tau {
                emit_one(ri, base_len + j, tau, out);
            }
        }
    }
}

/// `encode_kernel` with AVX-512 and no data-dependent branch: the compare gives the
/// crossing mask, a masked subtract updates the residual and a register compress packs
/// the codes, which are stored 16 at a time into spare capacity (branch mispredictions
/// on where codes fall otherwise cost more than the memory traffic).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn encode_avx512(r: &mut [f32], g: &[f32], tau: f32, out: &mut Vec<u32>) {
    use std::arch::x86_64::{
        _mm512_abs_ps, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512, _mm512_castps_si512,
        _mm512_castsi512_ps, _mm512_cmp_ps_mask, _mm512_loadu_ps, _mm512_mask_sub_ps,
        _mm512_maskz_compress_epi32, _mm512_or_si512, _mm512_set1_epi32, _mm512_set1_ps,
        _mm512_setr_epi32, _mm512_storeu_ps, _mm512_storeu_si512, _CMP_GE_OQ,
    };
    let n = r.len().min(g.len());
    let wide = n & !15;
    let tv = _mm512_set1_ps(tau);
    let sign = _mm512_set1_epi32(i32::MIN);
    let step = _mm512_set1_epi32(16);
    let mut idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let (rp, gp) = (r.as_mut_ptr(), g.as_ptr());
    let mut len = out.len();
    let mut i = 0;
    while i < wide {
        if out.capacity() - len < 16 {
            out.set_len(len);
            out.reserve(16.max(out.capacity() / 2));
        }
        // SAFETY: i + 16 <= wide <= n, within both slices; 16 spare code slots reserved.
        let sum = _mm512_add_ps(_mm512_loadu_ps(rp.add(i)), _mm512_loadu_ps(gp.add(i)));
        let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(sum), tv);
        let bits = _mm512_castps_si512(sum);
        let signed_tau = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(tv),
            _mm512_and_si512(bits, sign),
        ));
        _mm512_storeu_ps(rp.add(i), _mm512_mask_sub_ps(sum, m, sum, signed_tau));
        let codes = _mm512_or_si512(idx, _mm512_and_si512(bits, sign));
        _mm512_storeu_si512(
            out.as_mut_ptr().add(len).cast(),
            _mm512_maskz_compress_epi32(m, codes),
        );
        len += m.count_ones() as usize;
        idx = _mm512_add_epi32(idx, step);
        i += 16;
    }
    out.set_len(len);
    for j in wide..n {
        r[j] += g[j];
        if r[j].abs() >= tau {
            emit_one(&mut r[j], j, tau, out);
        }
    }
}

#[inline(always)]
fn emit_one(r: &mut f32, index: usize, tau: f32, out: &mut Vec<u32>) {
    if *r >= tau {
        *r -= tau;
        out.push(index as u32);
    } else {
        *r += tau;
        out.push(index as u32 | SIGN_BIT);
    }
}

/// Checks that codes address `0..n` in strictly ascending order.
pub fn validate(codes: &[u32], n: usize) -> Result<()> {
    let mut next = 0usize;
    for (k, &c) in codes.iter().enumerate() {
        let i = (c & !SIGN_BIT) as usize;
        if i >= n {
            return Err(invalid(format!(
                "threshold code {k} addresses element {i}, past the end ({n})"
            )));
        }
        if i < next {
            return Err(invalid(format!(
                "threshold codes must have strictly ascending indices (code {k}, index {i})"
            )));
        }
        next = i + 1;
    }
    Ok(())
}

/// Dense decode into `out` (overwritten): `±tau` at each coded index, zero elsewhere.
pub fn decode(codes: &[u32], tau: f32, out: &mut [f32]) -> Result<()> {
    check_tau(tau)?;
    validate(codes, out.len())?;
    out.fill(0.0);
    for &c in codes {
        let i = (c & !SIGN_BIT) as usize;
        out[i] = if c & SIGN_BIT != 0 { -tau } else { tau };
    }
    Ok(())
}

/// Dense size over payload size.
pub fn compression_ratio(n: usize, n_codes: usize) -> f64 {
    n as f64 / n_codes.max(1) as f64
}

/// A threshold payload as a gradient source for the store, decoded on the fly.
pub struct ThresholdGrad<'a> {
    codes: &'a [u32],
    tau: f32,
    n: usize,
    cursor: usize,
}

impl<'a> ThresholdGrad<'a> {
    /// Validates the codes against a vector of `n` elements.
    pub fn new(codes: &'a [u32], tau: f32, n: usize) -> Result<Self> {
        check_tau(tau)?;
        validate(codes, n)?;
        Ok(ThresholdGrad {
            codes,
            tau,
            n,
            cursor: 0,
        })
    }
}

impl GradSource for ThresholdGrad<'_> {
    fn len(&self) -> usize {
        self.n
    }

    fn chunk<'b>(&'b mut self, start: usize, buf: &'b mut [f32]) -> &'b [f32] {
        buf.fill(0.0);
        let end = start + buf.len();
        // Chunks usually come in order; after a wrap-around, find the first code again.
        let at_cursor = self
            .codes
            .get(self.cursor)
            .map(|&c| (c & !SIGN_BIT) as usize);
        let before = self
            .cursor
            .checked_sub(1)
            .map(|k| (self.codes[k] & !SIGN_BIT) as usize);
        if at_cursor.is_some_and(|i| i < start) || before.is_some_and(|i| i >= start) {
            self.cursor = self
                .codes
                .partition_point(|&c| ((c & !SIGN_BIT) as usize) < start);
        }
        while let Some(&c) = self.codes.get(self.cursor) {
            let i = (c & !SIGN_BIT) as usize;
            if i >= end {
                break;
            }
            if i >= start {
                buf[i - start] = if c & SIGN_BIT != 0 {
                    -self.tau
                } else {
                    self.tau
                };
            }
            self.cursor += 1;
        }
        buf
    }

    fn norm_sq(&self) -> f64 {
        f64::from(self.tau) * f64::from(self.tau) * self.codes.len() as f64
    }

    fn all_finite(&self) -> bool {
        true
    }

    fn sparse(&self) -> Option<(&[u32], f32)> {
        Some((self.codes, self.tau))
    }
}
