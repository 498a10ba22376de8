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
use crate::simd::{self, multiversion};

/// Largest vector the 31-bit index can address.
pub const MAX_LEN: usize = 1 << 31;

/// Sender state: the threshold and the residual carried between steps.
pub struct ThresholdEncoder {
    tau: f32,
    residual: Vec<f32>,
}

impl ThresholdEncoder {
    pub fn new(n: usize, tau: f32) -> Result<Self> {
        check_tau(tau)?;
        if n > MAX_LEN {
            return Err(invalid(format!(
                "threshold codes address at most 2^31 elements, got {n}"
            )));
        }
        Ok(ThresholdEncoder {
            tau,
            residual: vec![0.0; n],
        })
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
