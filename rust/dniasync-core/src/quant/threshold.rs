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
use crate::simd::lanes::{Lanes, Wide};
use crate::simd::{self, by_isa};

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
        encode_kernel(&mut self.residual, grad, self.tau, out);
        Ok(())
    }

    /// Like [`encode`](Self::encode), but emits at most `max_codes` codes: those of the
    /// elements that reached `±tau` from index `start` on, wrapping past the end to index 0
    /// (round-robin when `start` follows the last call's codes). The other elements keep
    /// `±tau` in their residual and are coded by a later call. The codes stay in ascending
    /// index order. Returns the index a next call starts from (one past the last code in
    /// the wrapped order), or `start` when nothing was left out.
    pub fn encode_capped(
        &mut self,
        grad: &[f32],
        max_codes: usize,
        start: usize,
        out: &mut Vec<u32>,
    ) -> Result<usize> {
        self.encode(grad, out)?;
        if out.len() <= max_codes {
            return Ok(start);
        }
        let index = |c: u32| (c & !SIGN_BIT) as usize;
        let first = out.partition_point(|&c| index(c) < start);
        let (low, high) = out.split_at(first);
        let wrapped = high.len() < max_codes;
        let mut kept: Vec<u32> = Vec::with_capacity(max_codes);
        if wrapped {
            kept.extend_from_slice(&low[..max_codes - high.len()]);
            kept.extend_from_slice(high);
        } else {
            kept.extend_from_slice(&high[..max_codes]);
        }
        let next = if wrapped {
            index(low[max_codes - high.len() - 1]) + 1
        } else {
            index(high[max_codes - 1]) + 1
        };
        let left = if wrapped {
            &low[max_codes - high.len()..]
        } else {
            // codes past the window, then the ones before `start`
            let (_, past) = high.split_at(max_codes);
            for &c in past {
                self.residual[index(c)] += if c & SIGN_BIT != 0 {
                    -self.tau
                } else {
                    self.tau
                };
            }
            low
        };
        for &c in left {
            self.residual[index(c)] += if c & SIGN_BIT != 0 {
                -self.tau
            } else {
                self.tau
            };
        }
        *out = kept;
        Ok(next)
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

by_isa! {
    fn encode_kernel(r: &mut [f32], g: &[f32], tau: f32, out: &mut Vec<u32>) {
        lanes L => encode_lanes::<L>(r, g, tau, out),
        // SAFETY: portable lanes need no CPU feature.
        base => unsafe { encode_lanes::<Wide>(r, g, tau, out) },
    }
}

/// Adds `g` into `r` and appends the codes of the elements that reach `tau`, `L::N` at a
/// time: a compare gives the crossing lanes, a masked subtract updates the residual and,
/// when some lane crossed, a compress packs the codes (no branch on where in the register
/// they fall; codes are sparse, so the one branch per register is mostly not taken).
#[inline(always)]
unsafe fn encode_lanes<L: Lanes>(r: &mut [f32], g: &[f32], tau: f32, out: &mut Vec<u32>) {
    assert_eq!(r.len(), g.len());
    let n = r.len();
    let wide = n - n % L::N;
    let (rp, gp) = (r.as_mut_ptr(), g.as_ptr());
    let mut len = out.len();
    let mut i = 0;
    while i < n {
        // SAFETY: `i + L::N <= n` (or one lane at a time past `wide`), within both slices.
        len += if i < wide {
            let k = encode_at::<L>(rp.add(i), gp.add(i), tau, i as u32, out, len);
            i += L::N;
            k
        } else {
            let k = encode_at::<f32>(rp.add(i), gp.add(i), tau, i as u32, out, len);
            i += 1;
            k
        };
    }
    out.set_len(len);
}

/// One register of `encode_lanes`: the codes go to `out` from `len` (`out`'s length is
/// not kept up to date); returns how many it wrote.
#[inline(always)]
unsafe fn encode_at<L: Lanes>(
    r: *mut f32,
    g: *const f32,
    tau: f32,
    first: u32,
    out: &mut Vec<u32>,
    len: usize,
) -> usize {
    let sum = L::load(r).add(L::load(g));
    let tau = L::splat(tau);
    let crossed = sum.abs().ge(tau);
    // Over +tau loses tau, under -tau gains it; the others lose zero (which keeps them as they are).
    let step = L::select(crossed, tau.copysign(sum), L::splat(0.0));
    sum.sub(step).store(r);
    if L::bits(crossed) == 0 {
        return 0;
    }
    if out.capacity() - len < L::N {
        out.set_len(len);
        out.reserve(L::N.max(out.capacity() / 2));
    }
    // SAFETY: `L::N` spare code slots after `len`.
    sum.compress_codes(crossed, first, out.as_mut_ptr().add(len))
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
