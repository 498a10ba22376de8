//! Vector-friendly building blocks shared by the kernels, and the choice of instruction set.
//!
//! Kernels are written once over `lanes::Lanes` and built for AVX-512, AVX2 and the
//! portable baseline (`by_isa!`); `isa()` picks one per call, so tests and benchmarks can
//! cap it (`with_isa`, `set_process_isa`, `DNIASYNC_ISA`) and compare them in one process.
//!
//! The store is made of `AtomicU32` cells, and LLVM never vectorises atomic accesses.
//! The x86 kernels move cells into vector registers and back with inline assembly; the
//! portable ones stage a chunk of cells into a stack buffer with wide moves, compute on
//! plain `f32` slices (which do vectorise), and write the chunk back. To the Rust abstract
//! machine an `asm!` block is an opaque operation, and each naturally aligned 4-byte lane
//! of an x86 vector move is accessed as one unit, so the block behaves as a run of
//! relaxed 32-bit atomic loads or stores, never a data race.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering::Relaxed};

pub mod lanes;
#[cfg(target_arch = "x86_64")]
pub mod x86;

/// Elements per staged chunk: four f32 buffers of this size fit in L1.
pub const CHUNK: usize = 1024;

/// A chunk-sized stack buffer aligned to a cache line, so wide moves never split lines.
#[repr(C, align(64))]
pub struct Buf(pub [f32; CHUNK]);

impl Buf {
    #[inline(always)]
    pub fn new() -> Buf {
        Buf([0.0; CHUNK])
    }
}

impl Default for Buf {
    fn default() -> Self {
        Buf::new()
    }
}

/// Defines `fn $name(args) -> ret` that runs its body compiled for AVX-512 or AVX2+FMA when
/// the CPU has them (checked at run time) and for the baseline target otherwise (for
/// kernels plain Rust vectorises well, in the same order of operations at every width).
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match $crate::simd::isa() {
                    // SAFETY: the CPU supports the features each variant was compiled for.
                    $crate::simd::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::simd::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::Isa::Base => {}
                }
            }
            body($($arg),*)
        }
    };
}

/// Defines `fn $name(args) -> ret` that runs `$lanes` (an expression generic over the
/// `Lanes` type named `$l`) with AVX-512 or AVX2 registers when this thread may use them
/// (`isa()`), and `$base`, the portable version, otherwise.
macro_rules! by_isa {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?
     { lanes $l:ident => $lanes:expr, base => $base:expr $(,)? }) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma,popcnt")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    type $l = $crate::simd::x86::Zmm;
                    // SAFETY: reached only on a CPU with these features (see below).
                    #[allow(unused_unsafe)]
                    unsafe { $lanes }
                }
                #[target_feature(enable = "avx2,fma,popcnt")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    type $l = $crate::simd::x86::Ymm;
                    // SAFETY: as above.
                    #[allow(unused_unsafe)]
                    unsafe { $lanes }
                }
                match $crate::simd::isa() {
                    // SAFETY: `isa()` never exceeds what the CPU was detected to have.
                    $crate::simd::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::simd::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::Isa::Base => {}
                }
            }
            $base
        }
    };
}
pub(crate) use by_isa;

/// An instruction set the kernels are built for, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The portable kernels, compiled for the baseline target (SSE2 on x86-64).
    Base,
    Avx2,
    Avx512,
}

impl Isa {
    const ALL: [Isa; 3] = [Isa::Base, Isa::Avx2, Isa::Avx512];

    /// "base", "avx2" or "avx512", as `DNIASYNC_ISA` and the Python API spell it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Base => "base",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }
}

thread_local! {
    static CAP: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// `set_process_isa`'s cap as `Isa as u8`; `u8::MAX` for none.
static PROCESS_CAP: AtomicU8 = AtomicU8::new(u8::MAX);

/// The widest set this CPU offers, detected once; `DNIASYNC_ISA=base|avx2|avx512` caps it.
pub fn detected_isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("DNIASYNC_ISA")
            .ok()
            .and_then(|v| Isa::from_name(v.trim()))
            .unwrap_or(Isa::Avx512);
        cpu_isa().min(cap)
    })
}

fn cpu_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("popcnt");
        if avx2
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512vl")
        {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Base
}

/// The set kernels use on this thread: the detected one, or less under `set_process_isa`
/// or inside `with_isa`.
#[inline]
pub fn isa() -> Isa {
    let mut isa = detected_isa();
    if let Some(&cap) = Isa::ALL.get(usize::from(PROCESS_CAP.load(Relaxed))) {
        isa = isa.min(cap);
    }
    CAP.with(|c| c.get()).map_or(isa, |cap| cap.min(isa))
}

/// Caps the kernels of every thread at `cap` (`None` lifts the cap): comparisons of the
/// instruction sets within one process, as `bench_core.py` makes.
pub fn set_process_isa(cap: Option<Isa>) {
    PROCESS_CAP.store(cap.map_or(u8::MAX, |c| c as u8), Relaxed);
}

/// Every set this CPU can run (within `DNIASYNC_ISA`), narrowest first.
pub fn available_isas() -> Vec<Isa> {
    Isa::ALL
        .into_iter()
        .filter(|&i| i <= detected_isa())
        .collect()
}

/// Runs `f` with this thread's kernels limited to `cap` (tests and comparisons).
pub fn with_isa<R>(cap: Isa, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Isa>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CAP.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CAP.with(|c| c.replace(Some(cap))));
    f()
}

/// Copies `src` cells into `dst` (relaxed, per element).
#[inline(always)]
pub fn load_cells(src: &[AtomicU32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let wide = wide_prefix(src.len());
    #[cfg(target_arch = "x86_64")]
    if wide > 0 {
        // SAFETY: both ranges hold `wide` valid, 4-byte aligned elements; see module docs.
        unsafe { move_wide(src.as_ptr().cast(), dst.as_mut_ptr().cast(), wide) };
    }
    for (d, s) in dst[wide..].iter_mut().zip(&src[wide..]) {
        *d = f32::from_bits(s.load(Relaxed));
    }
}

/// Copies `src` into the `dst` cells (relaxed, per element).
#[inline(always)]
pub fn store_cells(dst: &[AtomicU32], src: &[f32]) {
    assert_eq!(src.len(), dst.len());
    let wide = wide_prefix(src.len());
    #[cfg(target_arch = "x86_64")]
    if wide > 0 {
        // SAFETY: as in `load_cells`; the cells are shared, so writes go through asm.
        unsafe { move_wide(src.as_ptr().cast(), dst.as_ptr().cast_mut().cast(), wide) };
    }
    for (d, s) in dst[wide..].iter().zip(&src[wide..]) {
        d.store(s.to_bits(), Relaxed);
    }
}

#[inline(always)]
fn wide_prefix(n: usize) -> usize {
    if cfg!(target_arch = "x86_64") {
        n & !31
    } else {
        0
    }
}

/// Moves `n` (a positive multiple of 32) elements with the widest moves available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn move_wide(src: *const u8, dst: *mut u8, n: usize) {
    match isa() {
        Isa::Avx512 => move_zmm(src, dst, n),
        Isa::Avx2 => move_ymm(src, dst, n),
        Isa::Base => move16(src, dst, n),
    }
}

/// As `move16` with 64-byte AVX-512 moves (`n` a multiple of 32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn move_zmm(src: *const u8, dst: *mut u8, n: usize) {
    std::arch::asm!(
        "2:",
        "vmovups zmm0, [{s} + {i}]",
        "vmovups zmm1, [{s} + {i} + 64]",
        "vmovups [{d} + {i}], zmm0",
        "vmovups [{d} + {i} + 64], zmm1",
        "add {i}, 128",
        "cmp {i}, {end}",
        "jb 2b",
        s = in(reg) src,
        d = in(reg) dst,
        i = inout(reg) 0usize => _,
        end = in(reg) n * 4,
        out("zmm0") _, out("zmm1") _,
        options(nostack),
    );
}

/// As `move16` with 32-byte AVX moves (`n` a multiple of 32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
unsafe fn move_ymm(src: *const u8, dst: *mut u8, n: usize) {
    std::arch::asm!(
        "2:",
        "vmovups ymm0, [{s} + {i}]",
        "vmovups ymm1, [{s} + {i} + 32]",
        "vmovups ymm2, [{s} + {i} + 64]",
        "vmovups ymm3, [{s} + {i} + 96]",
        "vmovups [{d} + {i}], ymm0",
        "vmovups [{d} + {i} + 32], ymm1",
        "vmovups [{d} + {i} + 64], ymm2",
        "vmovups [{d} + {i} + 96], ymm3",
        "add {i}, 128",
        "cmp {i}, {end}",
        "jb 2b",
        s = in(reg) src,
        d = in(reg) dst,
        i = inout(reg) 0usize => _,
        end = in(reg) n * 4,
        out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
        options(nostack),
    );
}

/// Moves `n` (a positive multiple of 16) 4-byte elements with 16-byte SSE moves.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn move16(src: *const u8, dst: *mut u8, n: usize) {
    std::arch::asm!(
        "2:",
        "movups xmm0, [{s} + {i}]",
        "movups xmm1, [{s} + {i} + 16]",
        "movups xmm2, [{s} + {i} + 32]",
        "movups xmm3, [{s} + {i} + 48]",
        "movups [{d} + {i}], xmm0",
        "movups [{d} + {i} + 16], xmm1",
        "movups [{d} + {i} + 32], xmm2",
        "movups [{d} + {i} + 48], xmm3",
        "add {i}, 64",
        "cmp {i}, {end}",
        "jb 2b",
        s = in(reg) src,
        d = in(reg) dst,
        i = inout(reg) 0usize => _,
        end = in(reg) n * 4,
        out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
        options(nostack),
    );
}

/// True when no element is NaN or ±Inf (exponent bits all ones).
#[inline(always)]
pub fn all_finite_body(x: &[f32]) -> bool {
    const EXP: u32 = 0x7f80_0000;
    let mut bad = 0u32;
    let chunks = x.chunks_exact(64);
    let tail = chunks.remainder();
    for c in chunks {
        for v in c {
            bad |= u32::from(v.to_bits() & EXP == EXP);
        }
        if bad != 0 {
            return false;
        }
    }
    tail.iter().all(|v| v.is_finite())
}

multiversion! {
    /// True when every element of `x` is finite.
    pub fn all_finite(x: &[f32]) -> bool {
        all_finite_body(x)
    }
}

/// Sum of squares in eight f64 lanes (f64 so that large finite values cannot overflow).
#[inline(always)]
pub fn norm_sq_body(x: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let exact = x.chunks_exact(8);
    let tail = exact.remainder();
    for c in exact {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += f64::from(v) * f64::from(v);
        }
    }
    lanes.iter().sum::<f64>()
        + tail
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
}

multiversion! {
    /// Squared L2 norm of `x`.
    pub fn norm_sq(x: &[f32]) -> f64 {
        norm_sq_body(x)
    }
}
