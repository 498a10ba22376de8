//! AVX-512 optimizer kernels that move cells straight into registers and back (no
//! staging buffer). Each 64-byte `vmovups` in `asm!` is 16 relaxed 32-bit accesses (see
//! `simd`); the arithmetic is the same, in the same order, as the staged kernels, so both
//! give bit-identical results. The last `len % 16` elements go through the staged kernel.
use super::{adagrad_staged, adam_staged, momentum_staged, nesterov_staged, sgd_staged, Hyper};
use crate::grad::{Dense, GradSource};
use crate::simd::CHUNK;
use std::arch::asm;
use std::arch::x86_64::{
    __m512, _mm512_add_ps, _mm512_div_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_set1_ps,
    _mm512_sqrt_ps, _mm512_sub_ps,
};
use std::sync::atomic::AtomicU32;

/// 16 cells into a register.
macro_rules! load {
    ($cells:expr, $i:expr) => {{
        let v: __m512;
        asm!("vmovups {v}, [{p}]", p = in(reg) $cells.as_ptr().add($i), v = out(zmm_reg) v,
            options(nostack, readonly, preserves_flags));
        v
    }};
}

/// A register into 16 cells.
macro_rules! store {
    ($cells:expr, $i:expr, $v:expr) => {
        asm!("vmovups [{p}], {v}", p = in(reg) $cells.as_ptr().add($i), v = in(zmm_reg) $v,
            options(nostack, preserves_flags))
    };
}

/// Broadcast hyper-parameters.
struct Consts {
    lr: __m512,
    gs: __m512,
    wd: __m512,
    mu: __m512,
    eps: __m512,
    a1: __m512,
    a2: __m512,
    b2: __m512,
    step: __m512,
    bc2: __m512,
}

#[target_feature(enable = "avx512f")]
unsafe fn consts(h: &Hyper) -> Consts {
    Consts {
        lr: _mm512_set1_ps(h.lr),
        gs: _mm512_set1_ps(h.gscale),
        wd: _mm512_set1_ps(h.weight_decay),
        mu: _mm512_set1_ps(h.momentum),
        eps: _mm512_set1_ps(h.eps),
        a1: _mm512_set1_ps(1.0 - h.beta1),
        a2: _mm512_set1_ps(1.0 - h.beta2),
        b2: _mm512_set1_ps(h.beta2),
        step: _mm512_set1_ps(h.step_size),
        bc2: _mm512_set1_ps(h.bc2_sqrt),
    }
}

/// `g * gscale + weight_decay * w`, as `super::eff`.
macro_rules! eff {
    ($c:expr, $g:expr, $w:expr) => {
        _mm512_add_ps(_mm512_mul_ps($g, $c.gs), _mm512_mul_ps($c.wd, $w))
    };
}

/// Walks the source chunk by chunk (as `for_chunks`): `$body` runs for each full vector at `$i` with the
/// gradient vector `$gv`, then `$tail` with the range and gradient of what is left.
macro_rules! kernel {
    ($len:expr, $src:expr, $first:expr, |$s:ident, $i:ident, $gv:ident| $body:block,
     |$ts:ident, $tg:ident| $tail:block) => {
        super::for_chunks!($len, $src, $first, |$s, n, g| {
            let wide = n & !15;
            let mut $i = 0;
            while $i < wide {
                let $gv = _mm512_loadu_ps(g.as_ptr().add($i));
                $body
                $i += 16;
            }
            if wide < n {
                let $ts = $s + wide..$s + n;
                let $tg = &g[wide..];
                $tail
            }
        })
    };
}

#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sgd(w: &[AtomicU32], src: &mut dyn GradSource, h: &Hyper) {
    let c = consts(h);
    kernel!(
        w.len(),
        src,
        h.first_chunk,
        |s, i, gv| {
            let wv = load!(w, s + i);
            let d = eff!(c, gv, wv);
            store!(w, s + i, _mm512_sub_ps(wv, _mm512_mul_ps(c.lr, d)));
        },
        |r, g| {
            sgd_staged(&w[r], &mut Dense(g), h);
        }
    );
}

#[target_feature(enable = "avx512f")]
pub(super) unsafe fn momentum(
    w: &[AtomicU32],
    v: &[AtomicU32],
    src: &mut dyn GradSource,
    h: &Hyper,
) {
    let c = consts(h);
    kernel!(
        w.len(),
        src,
        h.first_chunk,
        |s, i, gv| {
            let (wv, vv) = (load!(w, s + i), load!(v, s + i));
            let v2 = _mm512_add_ps(_mm512_mul_ps(c.mu, vv), eff!(c, gv, wv));
            store!(v, s + i, v2);
            store!(w, s + i, _mm512_sub_ps(wv, _mm512_mul_ps(c.lr, v2)));
        },
        |r, g| {
            momentum_staged(&w[r.clone()], &v[r], &mut Dense(g), h);
        }
    );
}

#[target_feature(enable = "avx512f")]
pub(super) unsafe fn nesterov(
    w: &[AtomicU32],
    v: &[AtomicU32],
    src: &mut dyn GradSource,
    h: &Hyper,
) {
    let c = consts(h);
    kernel!(
        w.len(),
        src,
        h.first_chunk,
        |s, i, gv| {
            let (wv, vv) = (load!(w, s + i), load!(v, s + i));
            let d = eff!(c, gv, wv);
            let v2 = _mm512_add_ps(_mm512_mul_ps(c.mu, vv), d);
            store!(v, s + i, v2);
            let upd = _mm512_add_ps(d, _mm512_mul_ps(c.mu, v2));
            store!(w, s + i, _mm512_sub_ps(wv, _mm512_mul_ps(c.lr, upd)));
        },
        |r, g| {
            nesterov_staged(&w[r.clone()], &v[r], &mut Dense(g), h);
        }
    );
}

#[target_feature(enable = "avx512f")]
pub(super) unsafe fn adagrad(
    w: &[AtomicU32],
    acc: &[AtomicU32],
    src: &mut dyn GradSource,
    h: &Hyper,
) {
    let c = consts(h);
    kernel!(
        w.len(),
        src,
        h.first_chunk,
        |s, i, gv| {
            let (wv, av) = (load!(w, s + i), load!(acc, s + i));
            let d = eff!(c, gv, wv);
            let a2 = _mm512_add_ps(av, _mm512_mul_ps(d, d));
            store!(acc, s + i, a2);
            let den = _mm512_add_ps(_mm512_sqrt_ps(a2), c.eps);
            let upd = _mm512_div_ps(_mm512_mul_ps(c.lr, d), den);
            store!(w, s + i, _mm512_sub_ps(wv, upd));
        },
        |r, g| {
            adagrad_staged(&w[r.clone()], &acc[r], &mut Dense(g), h);
        }
    );
}

#[target_feature(enable = "avx512f")]
pub(super) unsafe fn adam(
    w: &[AtomicU32],
    m: &[AtomicU32],
    v: &[AtomicU32],
    src: &mut dyn GradSource,
    h: &Hyper,
) {
    let c = consts(h);
    kernel!(
        w.len(),
        src,
        h.first_chunk,
        |s, i, gv| {
            let (wv, mv, vv) = (load!(w, s + i), load!(m, s + i), load!(v, s + i));
            let d = eff!(c, gv, wv);
            let m2 = _mm512_add_ps(mv, _mm512_mul_ps(c.a1, _mm512_sub_ps(d, mv)));
            let v2 = _mm512_add_ps(
                _mm512_mul_ps(c.b2, vv),
                _mm512_mul_ps(_mm512_mul_ps(c.a2, d), d),
            );
            store!(m, s + i, m2);
            store!(v, s + i, v2);
            let den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v2), c.bc2), c.eps);
            let upd = _mm512_div_ps(_mm512_mul_ps(c.step, m2), den);
            store!(w, s + i, _mm512_sub_ps(wv, upd));
        },
        |r, g| {
            adam_staged(&w[r.clone()], &m[r.clone()], &v[r], &mut Dense(g), h);
        }
    );
}
