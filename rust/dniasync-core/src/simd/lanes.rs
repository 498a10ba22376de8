//! `Lanes`: one register's worth of f32 lanes and the few operations the kernels use.
//!
//! A kernel is written once, generic over `Lanes`, and instantiated for AVX-512 and AVX2
//! registers (`x86`), for the portable `Wide` (eight lanes in plain Rust that the compiler
//! vectorises for whatever the target has), and for `f32` (one lane: the tails). Every
//! operation is one IEEE-754 operation per lane, so a kernel gives bit-identical results
//! at every width as long as it keeps the same order of operations per element (and no
//! fused multiply-add: Rust never contracts `a * b + c` on its own, nor do these methods).
//! Reductions (sums) are the exception: a kernel that needs one keeps 16 partial sums
//! whatever the width (`VIRTUAL_LANES`) and adds them up in one fixed order.
use crate::optim::SIGN_BIT;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Partial sums a reduction keeps, whatever the register width, so its order is fixed.
pub const VIRTUAL_LANES: usize = 16;

/// Code of element `index` whose accumulated value is `x`: the index with `x`'s sign bit.
#[inline(always)]
pub fn code(index: u32, x: f32) -> u32 {
    index | (x.to_bits() & SIGN_BIT)
}

/// One register of `N` f32 lanes.
///
/// # Safety
/// Implementations for a CPU extension may only be used in code compiled for it (inside a
/// `#[target_feature]` function reached after the run-time check in `simd::isa`). Pointer
/// arguments must be valid for `N` elements (`compress_codes`: `N` spare slots).
pub unsafe trait Lanes: Copy {
    /// Lanes per register.
    const N: usize;
    /// The result of a comparison, lane by lane.
    type Mask: Copy;

    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// `N` relaxed atomic loads: a vector move is one access per naturally aligned 4-byte
    /// lane, so it races with nothing (see `simd`).
    unsafe fn load_cells(p: *const AtomicU32) -> Self;
    /// `N` relaxed atomic stores, as `load_cells`.
    unsafe fn store_cells(self, p: *const AtomicU32);

    unsafe fn add(self, o: Self) -> Self;
    unsafe fn sub(self, o: Self) -> Self;
    unsafe fn mul(self, o: Self) -> Self;
    unsafe fn div(self, o: Self) -> Self;
    unsafe fn sqrt(self) -> Self;
    unsafe fn abs(self) -> Self;
    /// `self` with the sign of `sign`.
    unsafe fn copysign(self, sign: Self) -> Self;

    /// `self >= o`, false when either is NaN.
    unsafe fn ge(self, o: Self) -> Self::Mask;
    /// `m ? a : b`, lane by lane.
    unsafe fn select(m: Self::Mask, a: Self, b: Self) -> Self;
    /// The mask as bits, lane `j` at bit `j`.
    unsafe fn bits(m: Self::Mask) -> u32;

    /// Lane maximum of `|self|` and `acc` (not negative) compared as integers: finite values
    /// order as floats do, and NaN and ±Inf above them all.
    unsafe fn max_abs_bits(self, acc: Self) -> Self;

    /// Truncates each lane (|x| < 128) towards zero and stores it as one signed byte.
    unsafe fn store_i8(self, out: *mut u8);
    /// `store_i8` of four registers, at `out`, `out + N`, ...
    #[inline(always)]
    unsafe fn store_i8x4(regs: [Self; 4], out: *mut u8) {
        for (k, r) in regs.into_iter().enumerate() {
            r.store_i8(out.add(k * Self::N));
        }
    }
    /// Writes the threshold codes (`code(first_index + j, x_j)`) of the lanes `j` set in `m`,
    /// in lane order, to `out` (it may write all `N` slots); returns how many it wrote.
    unsafe fn compress_codes(self, m: Self::Mask, first_index: u32, out: *mut u32) -> usize;

    /// The lanes, in order, into `out[..N]`.
    #[inline(always)]
    unsafe fn spill(self, out: &mut [f32]) {
        debug_assert!(out.len() >= Self::N);
        self.store(out.as_mut_ptr());
    }
}

/// One lane: the tails of every kernel, in the same operations as the wide bodies.
unsafe impl Lanes for f32 {
    const N: usize = 1;
    type Mask = bool;

    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        *p = self;
    }
    #[inline(always)]
    unsafe fn load_cells(p: *const AtomicU32) -> f32 {
        f32::from_bits((*p).load(Relaxed))
    }
    #[inline(always)]
    unsafe fn store_cells(self, p: *const AtomicU32) {
        (*p).store(self.to_bits(), Relaxed);
    }
    #[inline(always)]
    unsafe fn add(self, o: f32) -> f32 {
        self + o
    }
    #[inline(always)]
    unsafe fn sub(self, o: f32) -> f32 {
        self - o
    }
    #[inline(always)]
    unsafe fn mul(self, o: f32) -> f32 {
        self * o
    }
    #[inline(always)]
    unsafe fn div(self, o: f32) -> f32 {
        self / o
    }
    #[inline(always)]
    unsafe fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
    #[inline(always)]
    unsafe fn abs(self) -> f32 {
        f32::abs(self)
    }
    #[inline(always)]
    unsafe fn copysign(self, sign: f32) -> f32 {
        f32::copysign(self, sign)
    }
    #[inline(always)]
    unsafe fn ge(self, o: f32) -> bool {
        self >= o
    }
    #[inline(always)]
    unsafe fn select(m: bool, a: f32, b: f32) -> f32 {
        if m {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    unsafe fn bits(m: bool) -> u32 {
        u32::from(m)
    }
    #[inline(always)]
    unsafe fn max_abs_bits(self, acc: f32) -> f32 {
        f32::from_bits(self.abs().to_bits().max(acc.to_bits()))
    }
    #[inline(always)]
    unsafe fn store_i8(self, out: *mut u8) {
        // SAFETY: the caller keeps |x| < 128 (see the trait).
        *out = self.to_int_unchecked::<i8>() as u8;
    }
    #[inline(always)]
    unsafe fn compress_codes(self, m: bool, first_index: u32, out: *mut u32) -> usize {
        *out = code(first_index, self);
        usize::from(m)
    }
}

/// Eight lanes in plain Rust, for the portable kernels: each operation is a loop the
/// compiler turns into vector instructions of the baseline target (SSE2, NEON).
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct Wide([f32; 8]);

impl Wide {
    #[inline(always)]
    fn map(self, f: impl Fn(f32) -> f32) -> Wide {
        Wide(self.0.map(f))
    }

    #[inline(always)]
    fn zip(self, o: Wide, f: impl Fn(f32, f32) -> f32) -> Wide {
        Wide(std::array::from_fn(|j| f(self.0[j], o.0[j])))
    }
}

unsafe impl Lanes for Wide {
    const N: usize = 8;
    /// All ones or all zeros per lane, as vector compares give (bools vectorise badly).
    type Mask = [u32; 8];

    #[inline(always)]
    unsafe fn splat(x: f32) -> Wide {
        Wide([x; 8])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Wide {
        Wide(p.cast::<[f32; 8]>().read_unaligned())
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        p.cast::<[f32; 8]>().write_unaligned(self.0);
    }
    #[inline(always)]
    unsafe fn load_cells(p: *const AtomicU32) -> Wide {
        Wide(std::array::from_fn(|j| unsafe {
            f32::load_cells(p.add(j))
        }))
    }
    #[inline(always)]
    unsafe fn store_cells(self, p: *const AtomicU32) {
        for (j, x) in self.0.into_iter().enumerate() {
            x.store_cells(p.add(j));
        }
    }
    #[inline(always)]
    unsafe fn add(self, o: Wide) -> Wide {
        self.zip(o, |a, b| a + b)
    }
    #[inline(always)]
    unsafe fn sub(self, o: Wide) -> Wide {
        self.zip(o, |a, b| a - b)
    }
    #[inline(always)]
    unsafe fn mul(self, o: Wide) -> Wide {
        self.zip(o, |a, b| a * b)
    }
    #[inline(always)]
    unsafe fn div(self, o: Wide) -> Wide {
        self.zip(o, |a, b| a / b)
    }
    #[inline(always)]
    unsafe fn sqrt(self) -> Wide {
        self.map(f32::sqrt)
    }
    #[inline(always)]
    unsafe fn abs(self) -> Wide {
        self.map(f32::abs)
    }
    #[inline(always)]
    unsafe fn copysign(self, sign: Wide) -> Wide {
        self.zip(sign, f32::copysign)
    }
    #[inline(always)]
    unsafe fn ge(self, o: Wide) -> [u32; 8] {
        std::array::from_fn(|j| if self.0[j] >= o.0[j] { u32::MAX } else { 0 })
    }
    #[inline(always)]
    unsafe fn select(m: [u32; 8], a: Wide, b: Wide) -> Wide {
        Wide(std::array::from_fn(|j| {
            f32::from_bits((a.0[j].to_bits() & m[j]) | (b.0[j].to_bits() & !m[j]))
        }))
    }
    #[inline(always)]
    unsafe fn bits(m: [u32; 8]) -> u32 {
        let mut bits = 0;
        for (j, &x) in m.iter().enumerate() {
            bits |= (x >> 31) << j;
        }
        bits
    }
    #[inline(always)]
    unsafe fn max_abs_bits(self, acc: Wide) -> Wide {
        self.zip(acc, |x, a| unsafe { x.max_abs_bits(a) })
    }
    #[inline(always)]
    unsafe fn store_i8(self, out: *mut u8) {
        out.cast::<[u8; 8]>()
            .write_unaligned(self.0.map(|x| unsafe { x.to_int_unchecked::<i8>() } as u8));
    }
    #[inline(always)]
    unsafe fn compress_codes(self, m: [u32; 8], first_index: u32, out: *mut u32) -> usize {
        // No portable compress: visit the selected lanes (few, for the sparse codes this serves).
        let mut bits = Self::bits(m);
        let codes: [u32; 8] = std::array::from_fn(|j| code(first_index + j as u32, self.0[j]));
        let mut k = 0;
        while bits != 0 {
            *out.add(k) = codes[bits.trailing_zeros() as usize];
            k += 1;
            bits &= bits - 1;
        }
        k
    }
}

/// Adds up 16 partial sums in a fixed order (halves, then quarters, ...).
#[inline(always)]
pub fn sum16(mut x: [f32; VIRTUAL_LANES]) -> f32 {
    let mut half = VIRTUAL_LANES / 2;
    while half > 0 {
        for j in 0..half {
            x[j] += x[j + half];
        }
        half /= 2;
    }
    x[0]
}
