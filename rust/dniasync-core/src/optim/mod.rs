//! Optimizer kernels: one pass over a segment, chunk by chunk, parameters and state
//! staged through L1 so the arithmetic vectorises (see `simd`).
use crate::grad::GradSource;
use crate::layout::{Optimizer, OptimizerConfig};
use crate::simd::{load_cells, multiversion, store_cells, Buf, CHUNK};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Everything a kernel needs for one step, precomputed once per call.
#[derive(Clone, Copy, Debug)]
pub struct Hyper {
    pub lr: f32,
    pub weight_decay: f32,
    /// Gradient multiplier from clipping (1 when not clipped).
    pub gscale: f32,
    pub momentum: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Adam: `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// Adam: `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// Chunk the pass starts from (see `first_chunk`).
    pub first_chunk: usize,
}

impl Hyper {
    pub fn new(cfg: &OptimizerConfig, lr: f32, gscale: f32, t: u64) -> Hyper {
        let mut h = Hyper {
            lr,
            weight_decay: cfg.weight_decay,
            gscale,
            momentum: 0.0,
            beta1: 0.0,
            beta2: 0.0,
            eps: 0.0,
            step_size: lr,
            bc2_sqrt: 1.0,
            first_chunk: 0,
        };
        match cfg.optimizer {
            Optimizer::Sgd => {}
            Optimizer::Momentum { momentum } | Optimizer::Nesterov { momentum } => {
                h.momentum = momentum
            }
            Optimizer::Adagrad { eps } => h.eps = eps,
            Optimizer::Adam { beta1, beta2, eps } => {
                let t = i32::try_from(t).unwrap_or(i32::MAX);
                h.beta1 = beta1;
                h.beta2 = beta2;
                h.eps = eps;
                // Same arithmetic as torch's foreach Adam: powers in f64, then f32.
                let bc1 = 1.0 - f64::from(beta1).powi(t);
                let bc2 = 1.0 - f64::from(beta2).powi(t);
                h.step_size = (f64::from(lr) / bc1) as f32;
                h.bc2_sqrt = bc2.sqrt() as f32;
            }
        }
        h
    }
}

/// Runs `$body` with `$s` (start), `$n` (length) and `$g` (gradient chunk) bound, chunk by
/// chunk, starting at chunk `$first` and wrapping around. A macro rather than a closure:
/// closures are compiled without the target features of the function they sit in, which
/// would lose the vector code.
macro_rules! for_chunks {
    ($len:expr, $src:expr, $first:expr, |$s:ident, $n:ident, $g:ident| $body:block) => {{
        let mut gbuf = crate::simd::Buf::new();
        let len = $len;
        let chunks = len.div_ceil(CHUNK);
        for k in 0..chunks {
            let $s = ((k + $first) % chunks) * CHUNK;
            let $n = CHUNK.min(len - $s);
            let $g: &[f32] = $src.chunk($s, &mut gbuf.0[..$n]);
            $body
        }
    }};
}
pub(crate) use for_chunks;

/// The chunk a pass starts from: concurrent passes over one segment (Hogwild) start far
/// apart instead of fighting over the same cache lines in lockstep.
pub fn first_chunk(ticket: u64, len: usize) -> usize {
    let chunks = len.div_ceil(CHUNK).max(1);
    // Golden-ratio spacing keeps any few consecutive tickets well apart.
    ((ticket as f64 * 0.618_033_988_749_895).fract() * chunks as f64) as usize % chunks
}

#[cfg(target_arch = "x86_64")]
mod avx512;

/// Picks the AVX-512 kernel that keeps cells in registers when the CPU has it, else the
/// staged kernel compiled for the best instruction set available.
macro_rules! dispatch {
    ($(#[$m:meta])* $name:ident, $staged:ident, ($($arg:ident : $ty:ty),*)) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            if crate::simd::isa() == crate::simd::Isa::Avx512 {
                // SAFETY: the CPU has AVX-512F.
                return unsafe { avx512::$name($($arg),*) };
            }
            $staged($($arg),*)
        }
    };
}

dispatch!(
    /// `w -= lr * g`
    sgd, sgd_staged, (w: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper)
);
dispatch!(
    /// `v = m v + g; w -= lr v`
    momentum, momentum_staged, (w: &[AtomicU32], v: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper)
);
dispatch!(
    /// `v = m v + g; w -= lr (g + m v)`
    nesterov, nesterov_staged, (w: &[AtomicU32], v: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper)
);
dispatch!(
    /// `s += g²; w -= lr g / (√s + eps)`
    adagrad, adagrad_staged, (w: &[AtomicU32], acc: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper)
);
dispatch!(
    /// Adam, as `adam_staged`.
    adam, adam_staged, (w: &[AtomicU32], m: &[AtomicU32], v: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper)
);

/// The gradient after clipping scale and weight decay.
#[inline(always)]
pub(crate) fn eff(g: f32, w: f32, h: &Hyper) -> f32 {
    g * h.gscale + h.weight_decay * w
}

multiversion! {
    /// `w -= lr * g`
    pub fn sgd_staged(w: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper) {
        let mut wb = Buf::new();
        for_chunks!(w.len(), src, h.first_chunk, |s, n, g| {
            let (wc, wl) = (&w[s..s + n], &mut wb.0[..n]);
            load_cells(wc, wl);
            for (w, &g) in wl.iter_mut().zip(g) {
                *w -= h.lr * eff(g, *w, h);
            }
            store_cells(wc, wl);
        });
    }
}

multiversion! {
    /// `v = m v + g; w -= lr v`
    pub fn momentum_staged(w: &[AtomicU32], v: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper) {
        let (mut wb, mut vb) = (Buf::new(), Buf::new());
        for_chunks!(w.len(), src, h.first_chunk, |s, n, g| {
            let (wc, vc) = (&w[s..s + n], &v[s..s + n]);
            let (wl, vl) = (&mut wb.0[..n], &mut vb.0[..n]);
            load_cells(wc, wl);
            load_cells(vc, vl);
            for ((w, v), &g) in wl.iter_mut().zip(vl.iter_mut()).zip(g) {
                *v = h.momentum * *v + eff(g, *w, h);
                *w -= h.lr * *v;
            }
            store_cells(vc, vl);
            store_cells(wc, wl);
        });
    }
}

multiversion! {
    /// `v = m v + g; w -= lr (g + m v)`
    pub fn nesterov_staged(w: &[AtomicU32], v: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper) {
        let (mut wb, mut vb) = (Buf::new(), Buf::new());
        for_chunks!(w.len(), src, h.first_chunk, |s, n, g| {
            let (wc, vc) = (&w[s..s + n], &v[s..s + n]);
            let (wl, vl) = (&mut wb.0[..n], &mut vb.0[..n]);
            load_cells(wc, wl);
            load_cells(vc, vl);
            for ((w, v), &g) in wl.iter_mut().zip(vl.iter_mut()).zip(g) {
                let d = eff(g, *w, h);
                *v = h.momentum * *v + d;
                *w -= h.lr * (d + h.momentum * *v);
            }
            store_cells(vc, vl);
            store_cells(wc, wl);
        });
    }
}

multiversion! {
    /// `s += g²; w -= lr g / (√s + eps)`
    pub fn adagrad_staged(w: &[AtomicU32], acc: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper) {
        let (mut wb, mut sb) = (Buf::new(), Buf::new());
        for_chunks!(w.len(), src, h.first_chunk, |s, n, g| {
            let (wc, sc) = (&w[s..s + n], &acc[s..s + n]);
            let (wl, sl) = (&mut wb.0[..n], &mut sb.0[..n]);
            load_cells(wc, wl);
            load_cells(sc, sl);
            for ((w, a), &g) in wl.iter_mut().zip(sl.iter_mut()).zip(g) {
                let d = eff(g, *w, h);
                *a += d * d;
                *w -= h.lr * d / (a.sqrt() + h.eps);
            }
            store_cells(sc, sl);
            store_cells(wc, wl);
        });
    }
}

multiversion! {
    /// Adam with torch's arithmetic: `m = lerp(m, g, 1-b1); v = b2 v + (1-b2) g²;
    /// w -= step_size m / (√v / √bc2 + eps)`
    pub fn adam_staged(
        w: &[AtomicU32],
        m: &[AtomicU32],
        v: &[AtomicU32],
        src: &mut dyn GradSource,
        h: &Hyper,
    ) {
        let (mut wb, mut mb, mut vb) = (Buf::new(), Buf::new(), Buf::new());
        let (a1, a2) = (1.0 - h.beta1, 1.0 - h.beta2);
        for_chunks!(w.len(), src, h.first_chunk, |s, n, g| {
            let (wc, mc, vc) = (&w[s..s + n], &m[s..s + n], &v[s..s + n]);
            let (wl, ml, vl) = (&mut wb.0[..n], &mut mb.0[..n], &mut vb.0[..n]);
            load_cells(wc, wl);
            load_cells(mc, ml);
            load_cells(vc, vl);
            for (((w, m), v), &g) in wl.iter_mut().zip(ml.iter_mut()).zip(vl.iter_mut()).zip(g) {
                let d = eff(g, *w, h);
                *m += a1 * (d - *m);
                *v = h.beta2 * *v + a2 * d * d;
                *w -= h.step_size * *m / (v.sqrt() / h.bc2_sqrt + h.eps);
            }
            store_cells(mc, ml);
            store_cells(vc, vl);
            store_cells(wc, wl);
        });
    }
}

multiversion! {
    /// `w += alpha * d`
    pub fn axpy(w: &[AtomicU32], src: &mut dyn GradSource, alpha: f32, first: usize) {
        let mut wb = Buf::new();
        for_chunks!(w.len(), src, first, |s, n, d| {
            let (wc, wl) = (&w[s..s + n], &mut wb.0[..n]);
            load_cells(wc, wl);
            for (w, &d) in wl.iter_mut().zip(d) {
                *w += alpha * d;
            }
            store_cells(wc, wl);
        });
    }
}

/// Whether a step with a sparse gradient may skip the zero elements: true when a zero
/// gradient leaves both parameter and state untouched (SGD and Adagrad, no weight decay).
pub fn sparse_ok(cfg: &OptimizerConfig) -> bool {
    cfg.weight_decay == 0.0 && matches!(cfg.optimizer, Optimizer::Sgd | Optimizer::Adagrad { .. })
}

/// Sign bit of a packed (sign, index) code.
pub const SIGN_BIT: u32 = 1 << 31;

#[inline(always)]
fn unpack(code: u32, tau: f32) -> (usize, f32) {
    let idx = (code & !SIGN_BIT) as usize;
    (idx, if code & SIGN_BIT != 0 { -tau } else { tau })
}

/// Sparse SGD or Adagrad step touching only the coded elements.
pub fn sparse_step(h: &Hyper, w: &[AtomicU32], acc: Option<&[AtomicU32]>, codes: &[u32], tau: f32) {
    for &c in codes {
        let (i, g) = unpack(c, tau);
        let g = g * h.gscale;
        let wi = f32::from_bits(w[i].load(Relaxed));
        let step = match acc {
            Some(acc) => {
                let a = f32::from_bits(acc[i].load(Relaxed)) + g * g;
                acc[i].store(a.to_bits(), Relaxed);
                h.lr * g / (a.sqrt() + h.eps)
            }
            None => h.lr * g,
        };
        w[i].store((wi - step).to_bits(), Relaxed);
    }
}

/// `w[i] += ±delta` at each coded element.
pub fn sparse_add(w: &[AtomicU32], codes: &[u32], delta: f32) {
    for &c in codes {
        let (i, d) = unpack(c, delta);
        let wi = f32::from_bits(w[i].load(Relaxed));
        w[i].store((wi + d).to_bits(), Relaxed);
    }
}
