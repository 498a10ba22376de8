//! Float64 vector kernels for Sandblaster L-BFGS on the parameter-server shards.
//!
//! The coordinator never holds a vector: it sends commands that each shard runs on its own
//! slice (dot products, `x + a·y`, scaling, linear combinations of its history) and gets
//! scalars back. Every kernel checks lengths and returns [`CoreError::LengthMismatch`]
//! rather than panicking. Reductions accumulate in eight lanes so they vectorize; the
//! result differs from a sequential sum only by rounding.
use crate::error::{CoreError, Result};

const LANES: usize = 8;

fn same_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(CoreError::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

/// `a · b`.
pub fn dot(a: &[f64], b: &[f64]) -> Result<f64> {
    same_len("b", a.len(), b.len())?;
    let mut lanes = [0f64; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (xa, xb) in ca.zip(cb) {
        for ((l, x), y) in lanes.iter_mut().zip(xa).zip(xb) {
            *l += x * y;
        }
    }
    Ok(lanes.iter().sum::<f64>() + tail)
}

/// `y += alpha · x`.
pub fn axpy(alpha: f64, x: &[f64], y: &mut [f64]) -> Result<()> {
    same_len("x", y.len(), x.len())?;
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
    Ok(())
}

/// `x *= alpha`.
pub fn scale(alpha: f64, x: &mut [f64]) {
    for xi in x.iter_mut() {
        *xi *= alpha;
    }
}

/// `out = x + alpha · y` (a trial point `x + t·d`, a difference `g' − g`).
pub fn add_scaled(out: &mut [f64], x: &[f64], alpha: f64, y: &[f64]) -> Result<()> {
    same_len("x", out.len(), x.len())?;
    same_len("y", out.len(), y.len())?;
    for ((o, xi), yi) in out.iter_mut().zip(x).zip(y) {
        *o = xi + alpha * yi;
    }
    Ok(())
}

/// `out = Σ coeffs[i] · vectors[i]` (the two-loop direction over the shard's history;
/// with unit coefficients, the sum of staged gradients in the given order).
pub fn lincomb(out: &mut [f64], coeffs: &[f64], vectors: &[&[f64]]) -> Result<()> {
    same_len("coeffs", vectors.len(), coeffs.len())?;
    for v in vectors {
        same_len("vector", out.len(), v.len())?;
    }
    out.fill(0.0);
    for (c, v) in coeffs.iter().zip(vectors) {
        axpy(*c, v, out)?;
    }
    Ok(())
}

/// `(Σ |x_i|, max |x_i|)`: the L1 norm (the first step of L-BFGS) and the max norm
/// (its gradient tolerance), in one pass.
pub fn abs_sum_max(x: &[f64]) -> (f64, f64) {
    let mut sums = [0f64; LANES];
    let mut maxs = [0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for ((s, m), v) in sums.iter_mut().zip(maxs.iter_mut()).zip(c) {
            let a = v.abs();
            *s += a;
            *m = m.max(a);
        }
    }
    let mut sum = sums.iter().sum::<f64>();
    let mut max = maxs.iter().fold(0f64, |m, &v| m.max(v));
    for v in tail {
        sum += v.abs();
        max = max.max(v.abs());
    }
    if x.iter().any(|v| v.is_nan()) {
        max = f64::NAN;
    }
    (sum, max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seq_dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    proptest! {
        #[test]
        fn dot_matches_sequential(v in proptest::collection::vec((-1e3f64..1e3, -1e3f64..1e3), 0..200)) {
            let (a, b): (Vec<f64>, Vec<f64>) = v.into_iter().unzip();
            let got = dot(&a, &b).unwrap();
            let want = seq_dot(&a, &b);
            let scale = seq_dot(&a.iter().map(|x| x.abs()).collect::<Vec<_>>(),
                                &b.iter().map(|x| x.abs()).collect::<Vec<_>>());
            prop_assert!((got - want).abs() <= 1e-12 * scale.max(1.0));
        }

        #[test]
        fn abs_sum_max_matches(x in proptest::collection::vec(-1e3f64..1e3, 0..100)) {
            let (s, m) = abs_sum_max(&x);
            let want_s: f64 = x.iter().map(|v| v.abs()).sum();
            let want_m = x.iter().fold(0f64, |m, v| m.max(v.abs()));
            prop_assert!((s - want_s).abs() <= 1e-9 * want_s.max(1.0));
            prop_assert_eq!(m, want_m);
        }
    }

    #[test]
    fn axpy_scale_add_scaled() {
        let x = [1.0, 2.0, 3.0];
        let mut y = [1.0, 1.0, 1.0];
        axpy(2.0, &x, &mut y).unwrap();
        assert_eq!(y, [3.0, 5.0, 7.0]);
        scale(0.5, &mut y);
        assert_eq!(y, [1.5, 2.5, 3.5]);
        let mut out = [0.0; 3];
        add_scaled(&mut out, &x, -1.0, &y).unwrap();
        assert_eq!(out, [-0.5, -0.5, -0.5]);
    }

    #[test]
    fn lincomb_sums_in_order() {
        let a = [1.0, 0.0];
        let b = [0.0, 2.0];
        let mut out = [9.0, 9.0];
        lincomb(&mut out, &[3.0, -1.0], &[&a, &b]).unwrap();
        assert_eq!(out, [3.0, -2.0]);
        lincomb(&mut out, &[], &[]).unwrap();
        assert_eq!(out, [0.0, 0.0]);
    }

    #[test]
    fn lengths_are_checked() {
        assert!(dot(&[1.0], &[1.0, 2.0]).is_err());
        assert!(axpy(1.0, &[1.0], &mut [1.0, 2.0]).is_err());
        assert!(add_scaled(&mut [0.0; 2], &[1.0], 1.0, &[1.0, 2.0]).is_err());
        assert!(lincomb(&mut [0.0; 2], &[1.0], &[&[1.0]]).is_err());
        assert!(lincomb(&mut [0.0; 2], &[1.0, 2.0], &[&[1.0, 2.0]]).is_err());
    }

    #[test]
    fn nan_shows_in_max() {
        assert!(abs_sum_max(&[1.0, f64::NAN]).1.is_nan());
    }
}
