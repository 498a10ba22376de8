//! 8-bit blockwise quantization: per block of `block` elements one f32 scale
//! (`max |g| / 127`) and one signed byte per element (`round(g / scale)`).
//! Stateless; each element is off by at most half its block's scale.
//!
//! Payload (little endian): `n_blocks` f32 scales, then `n` i8 codes.
use crate::error::{check_len, invalid, CoreError, Result};
use crate::grad::GradSource;
use crate::quant::{read_f32s, Codec};
use crate::simd::{self, multiversion};

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

/// Encodes `grad` into `out` (resized). Rejects NaN/Inf.
pub fn encode(grad: &[f32], block: usize, out: &mut Vec<u8>) -> Result<()> {
    check_block(block)?;
    if !simd::all_finite(grad) {
        return Err(CoreError::NonFinite { what: "gradient" });
    }
    out.clear();
    out.resize(payload_len(grad.len(), block), 0);
    let (scales, codes) = out.split_at_mut(grad.len().div_ceil(block) * 4);
    encode_kernel(grad, block, scales, codes);
    Ok(())
}

multiversion! {
    fn encode_kernel(g: &[f32], block: usize, scales: &mut [u8], codes: &mut [u8]) {
        for (b, (gc, cc)) in g.chunks(block).zip(codes.chunks_mut(block)).enumerate() {
            let mut lanes = [0f32; 8];
            let exact = gc.chunks_exact(8);
            let mut m = exact.remainder().iter().fold(0f32, |m, v| m.max(v.abs()));
            for c in exact {
                for (l, v) in lanes.iter_mut().zip(c) {
                    *l = l.max(v.abs());
                }
            }
            m = lanes.iter().fold(m, |a, &b| a.max(b));
            let scale = m / 127.0;
            let inv = if m > 0.0 { 127.0 / m } else { 0.0 };
            scales[4 * b..4 * b + 4].copy_from_slice(&scale.to_le_bytes());
            for (c, &v) in cc.iter_mut().zip(gc) {
                *c = ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8;
            }
        }
    }
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
