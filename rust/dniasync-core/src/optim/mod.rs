//! Optimizer kernels: one pass over a segment, chunk by chunk.
//!
//! Each update rule is written once, over `Lanes` (`Rule`). `direct` runs it on registers
//! moved straight from the cells and back (AVX2, AVX-512); `staged` copies a chunk of
//! cells into L1, runs it one element at a time on plain `f32`s, which the compiler
//! vectorises for the baseline target, and copies the chunk back (the portable path).
//! Both do the same IEEE operations in the same order, so every ISA gives the same bits.
use crate::grad::GradSource;
use crate::layout::{Optimizer, OptimizerConfig};
use crate::simd::lanes::Lanes;
use crate::simd::{by_isa, load_cells, store_cells, Buf, CHUNK};
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

/// The chunk a pass starts from: concurrent passes over one segment (Hogwild) start far
/// apart instead of fighting over the same cache lines in lockstep.
pub fn first_chunk(ticket: u64, len: usize) -> usize {
    let chunks = len.div_ceil(CHUNK).max(1);
    // Golden-ratio spacing keeps any few consecutive tickets well apart.
    ((ticket as f64 * 0.618_033_988_749_895).fract() * chunks as f64) as usize % chunks
}

/// Hyper-parameters broadcast into lanes.
#[derive(Clone, Copy)]
pub(crate) struct Consts<V> {
    lr: V,
    gs: V,
    wd: V,
    mu: V,
    eps: V,
    a1: V,
    a2: V,
    b2: V,
    step: V,
    bc2: V,
}

impl<V: Lanes> Consts<V> {
    #[inline(always)]
    unsafe fn new(h: &Hyper) -> Self {
        Consts {
            lr: V::splat(h.lr),
            gs: V::splat(h.gscale),
            wd: V::splat(h.weight_decay),
            mu: V::splat(h.momentum),
            eps: V::splat(h.eps),
            a1: V::splat(1.0 - h.beta1),
            a2: V::splat(1.0 - h.beta2),
            b2: V::splat(h.beta2),
            step: V::splat(h.step_size),
            bc2: V::splat(h.bc2_sqrt),
        }
    }

    /// The gradient after clipping scale and weight decay: `g * gscale + weight_decay * w`.
    #[inline(always)]
    unsafe fn eff(&self, g: V, w: V) -> V {
        g.mul(self.gs).add(self.wd.mul(w))
    }
}

/// An update rule with `S` state slots: new parameter and state from old ones and the
/// gradient, in lanes of any width.
pub(crate) trait Rule<const S: usize> {
    unsafe fn apply<V: Lanes>(c: &Consts<V>, w: V, state: [V; S], g: V) -> (V, [V; S]);
}

/// `w -= lr * g`
pub(crate) struct Sgd;
/// `v = m v + g; w -= lr v`
pub(crate) struct Momentum;
/// `v = m v + g; w -= lr (g + m v)`
pub(crate) struct Nesterov;
/// `s += g²; w -= lr g / (√s + eps)`
pub(crate) struct Adagrad;
/// Adam with torch's arithmetic: `m = lerp(m, g, 1-b1); v = b2 v + (1-b2) g²;
/// w -= step_size m / (√v / √bc2 + eps)`
pub(crate) struct Adam;
/// `w += alpha * d`, alpha given as the learning rate (no clipping, no weight decay).
pub(crate) struct Axpy;

impl Rule<0> for Sgd {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(c: &Consts<V>, w: V, _: [V; 0], g: V) -> (V, [V; 0]) {
        (w.sub(c.lr.mul(c.eff(g, w))), [])
    }
}

impl Rule<1> for Momentum {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(c: &Consts<V>, w: V, [v]: [V; 1], g: V) -> (V, [V; 1]) {
        let v = c.mu.mul(v).add(c.eff(g, w));
        (w.sub(c.lr.mul(v)), [v])
    }
}

impl Rule<1> for Nesterov {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(c: &Consts<V>, w: V, [v]: [V; 1], g: V) -> (V, [V; 1]) {
        let d = c.eff(g, w);
        let v = c.mu.mul(v).add(d);
        (w.sub(c.lr.mul(d.add(c.mu.mul(v)))), [v])
    }
}

impl Rule<1> for Adagrad {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(c: &Consts<V>, w: V, [s]: [V; 1], g: V) -> (V, [V; 1]) {
        let d = c.eff(g, w);
        let s = s.add(d.mul(d));
        (w.sub(c.lr.mul(d).div(s.sqrt().add(c.eps))), [s])
    }
}

impl Rule<2> for Adam {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(c: &Consts<V>, w: V, [m, v]: [V; 2], g: V) -> (V, [V; 2]) {
        let d = c.eff(g, w);
        let m = m.add(c.a1.mul(d.sub(m)));
        let v = c.b2.mul(v).add(c.a2.mul(d).mul(d));
        let den = v.sqrt().div(c.bc2).add(c.eps);
        (w.sub(c.step.mul(m).div(den)), [m, v])
    }
}

impl Rule<0> for Axpy {
    #[inline(always)]
    unsafe fn apply<V: Lanes>(c: &Consts<V>, w: V, _: [V; 0], d: V) -> (V, [V; 0]) {
        (w.add(c.lr.mul(d)), [])
    }
}

/// One rule application on the `V::N` elements at `w`, `state` and `g` (cells read and
/// written in place; state first, then the parameter). With a non-null `out` the parameter
/// cells stay as they are and `out` receives the change the step makes to them (the new
/// value, rounded as the in-place step rounds it, minus the old).
#[inline(always)]
unsafe fn apply_at<V: Lanes, R: Rule<S>, const S: usize>(
    c: &Consts<V>,
    w: *const AtomicU32,
    state: [*const AtomicU32; S],
    g: *const f32,
    out: *mut f32,
) {
    let mut old = [V::splat(0.0); S];
    for (o, &p) in old.iter_mut().zip(&state) {
        *o = V::load_cells(p);
    }
    let w0 = V::load_cells(w);
    let (w2, new) = R::apply(c, w0, old, V::load(g));
    for (n, &p) in new.iter().zip(&state) {
        n.store_cells(p);
    }
    if out.is_null() {
        w2.store_cells(w);
    } else {
        w2.sub(w0).store(out);
    }
}

/// Where a kernel's new parameters go: back into the cells (`None`), or their change into
/// `out`, one element per cell, the cells left as they are (`step_into`).
fn out_ptr(out: Option<&mut [f32]>, len: usize) -> *mut f32 {
    match out {
        Some(o) => {
            assert_eq!(
                o.len(),
                len,
                "the change buffer must have the segment's length"
            );
            o.as_mut_ptr()
        }
        None => std::ptr::null_mut(),
    }
}

/// Runs rule `R` over the segment with registers of `V` moved straight from the cells;
/// what is left of each chunk after the last full register goes one element at a time.
#[inline(always)]
unsafe fn direct<V: Lanes, R: Rule<S>, const S: usize>(
    w: &[AtomicU32],
    state: [&[AtomicU32]; S],
    src: &mut dyn GradSource,
    h: &Hyper,
    out: Option<&mut [f32]>,
) {
    assert!(state.iter().all(|st| st.len() == w.len()));
    let out = out_ptr(out, w.len());
    let (c, c1) = (Consts::<V>::new(h), Consts::<f32>::new(h));
    // The cells of `w` and of each state slot at element `i`, and `out` there (null: none).
    let at = |i: usize| {
        let o = if out.is_null() { out } else { out.add(i) };
        (w[i..].as_ptr(), state.map(|st| st[i..].as_ptr()), o)
    };
    for_chunks!(w.len(), src, h.first_chunk, |s, n, g| {
        let wide = n - n % V::N;
        let mut i = 0;
        while i < wide {
            // SAFETY: `s + i + V::N <= s + n <= w.len()` (`out` has that length too), and `g`
            // holds `n` elements.
            let (wp, sp, op) = at(s + i);
            apply_at::<V, R, S>(&c, wp, sp, g.as_ptr().add(i), op);
            i += V::N;
        }
        while i < n {
            let (wp, sp, op) = at(s + i);
            apply_at::<f32, R, S>(&c1, wp, sp, g.as_ptr().add(i), op);
            i += 1;
        }
    });
}

/// Runs rule `R` over the segment on chunks staged through L1 (the portable path).
fn staged<R: Rule<S>, const S: usize>(
    w: &[AtomicU32],
    state: [&[AtomicU32]; S],
    src: &mut dyn GradSource,
    h: &Hyper,
    mut out: Option<&mut [f32]>,
) {
    if let Some(o) = &out {
        assert_eq!(
            o.len(),
            w.len(),
            "the change buffer must have the segment's length"
        );
    }
    let delta = out.is_some();
    // SAFETY: f32 lanes need no CPU feature.
    let c = unsafe { Consts::<f32>::new(h) };
    let mut wb = Buf::new();
    let mut sb: [Buf; S] = std::array::from_fn(|_| Buf::new());
    for_chunks!(w.len(), src, h.first_chunk, |s, n, g| {
        load_cells(&w[s..s + n], &mut wb.0[..n]);
        for (st, b) in state.iter().zip(&mut sb) {
            load_cells(&st[s..s + n], &mut b.0[..n]);
        }
        for (i, &gi) in g.iter().enumerate() {
            let old = std::array::from_fn(|k| sb[k].0[i]);
            // SAFETY: as above.
            let (w2, new) = unsafe { R::apply(&c, wb.0[i], old, gi) };
            for (b, x) in sb.iter_mut().zip(new) {
                b.0[i] = x;
            }
            // the new value, or (into `out`) its change
            wb.0[i] = if delta { w2 - wb.0[i] } else { w2 };
        }
        for (st, b) in state.iter().zip(&sb) {
            store_cells(&st[s..s + n], &b.0[..n]);
        }
        match out.as_deref_mut() {
            None => store_cells(&w[s..s + n], &wb.0[..n]),
            Some(o) => o[s..s + n].copy_from_slice(&wb.0[..n]),
        }
    });
}

by_isa! {
    /// `w -= lr * g`
    pub fn sgd(
        w: &[AtomicU32],

        src: &mut dyn GradSource,
        h: &Hyper,
        out: Option<&mut [f32]>,
    ) {
        lanes L => direct::<L, Sgd, 0>(w, [], src, h, out),
        base => staged::<Sgd, 0>(w, [], src, h, out),
    }
}

by_isa! {
    /// `v = m v + g; w -= lr v`
    pub fn momentum(
        w: &[AtomicU32],
        v: &[AtomicU32],
        src: &mut dyn GradSource,
        h: &Hyper,
        out: Option<&mut [f32]>,
    ) {
        lanes L => direct::<L, Momentum, 1>(w, [v], src, h, out),
        base => staged::<Momentum, 1>(w, [v], src, h, out),
    }
}

by_isa! {
    /// `v = m v + g; w -= lr (g + m v)`
    pub fn nesterov(
        w: &[AtomicU32],
        v: &[AtomicU32],
        src: &mut dyn GradSource,
        h: &Hyper,
        out: Option<&mut [f32]>,
    ) {
        lanes L => direct::<L, Nesterov, 1>(w, [v], src, h, out),
        base => staged::<Nesterov, 1>(w, [v], src, h, out),
    }
}

by_isa! {
    /// `s += g²; w -= lr g / (√s + eps)`
    pub fn adagrad(
        w: &[AtomicU32],
        acc: &[AtomicU32],
        src: &mut dyn GradSource,
        h: &Hyper,
        out: Option<&mut [f32]>,
    ) {
        lanes L => direct::<L, Adagrad, 1>(w, [acc], src, h, out),
        base => staged::<Adagrad, 1>(w, [acc], src, h, out),
    }
}

by_isa! {
    /// Adam, as `Adam`.
    pub fn adam(
        w: &[AtomicU32],
        m: &[AtomicU32],
        v: &[AtomicU32],
        src: &mut dyn GradSource,
        h: &Hyper,
        out: Option<&mut [f32]>,
    ) {
        lanes L => direct::<L, Adam, 2>(w, [m, v], src, h, out),
        base => staged::<Adam, 2>(w, [m, v], src, h, out),
    }
}

/// `w += alpha * d`
pub fn axpy(w: &[AtomicU32], src: &mut dyn GradSource, alpha: f32, first: usize) {
    let mut h = Hyper::new(&OptimizerConfig::new(Optimizer::Sgd), alpha, 1.0, 0);
    h.first_chunk = first;
    axpy_kernel(w, src, &h);
}

by_isa! {
    fn axpy_kernel(w: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper) {
        lanes L => direct::<L, Axpy, 0>(w, [], src, h, None),
        base => staged::<Axpy, 0>(w, [], src, h, None),
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
