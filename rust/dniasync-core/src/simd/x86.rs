//! `Lanes` in AVX2 (`Ymm`, 8 lanes) and AVX-512 (`Zmm`, 16 lanes) registers.
//!
//! Each method is compiled for its extension and inlined into the kernels built for it
//! (`simd::by_isa`). Cell moves are `asm!`: an opaque vector move is a run of relaxed
//! 32-bit accesses (see `simd`), where a plain intrinsic load would be a data race.
use super::lanes::Lanes;
use crate::optim::SIGN_BIT;
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::atomic::AtomicU32;

/// For each 8-bit mask, the lanes it selects, in order, one per byte (AVX2 has no
/// compress instruction; a permute by this table does the same).
static COMPRESS8: [u64; 256] = {
    let mut table = [0u64; 256];
    let mut mask = 0;
    while mask < 256 {
        let (mut lane, mut k, mut perm) = (0, 0, 0u64);
        while lane < 8 {
            if mask >> lane & 1 == 1 {
                perm |= (lane as u64) << (8 * k);
                k += 1;
            }
            lane += 1;
        }
        table[mask] = perm;
        mask += 1;
    }
    table
};

/// Eight f32 lanes in a `ymm` register.
#[derive(Clone, Copy)]
pub struct Ymm(__m256);

unsafe impl Lanes for Ymm {
    const N: usize = 8;
    type Mask = __m256;

    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn splat(x: f32) -> Ymm {
        Ymm(_mm256_set1_ps(x))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn load(p: *const f32) -> Ymm {
        Ymm(_mm256_loadu_ps(p))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0)
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn load_cells(p: *const AtomicU32) -> Ymm {
        let v: __m256;
        asm!("vmovups {v}, [{p}]", p = in(reg) p, v = out(ymm_reg) v,
            options(nostack, readonly, preserves_flags));
        Ymm(v)
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn store_cells(self, p: *const AtomicU32) {
        asm!("vmovups [{p}], {v}", p = in(reg) p, v = in(ymm_reg) self.0,
            options(nostack, preserves_flags));
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn add(self, o: Ymm) -> Ymm {
        Ymm(_mm256_add_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn sub(self, o: Ymm) -> Ymm {
        Ymm(_mm256_sub_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn mul(self, o: Ymm) -> Ymm {
        Ymm(_mm256_mul_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn div(self, o: Ymm) -> Ymm {
        Ymm(_mm256_div_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn sqrt(self) -> Ymm {
        Ymm(_mm256_sqrt_ps(self.0))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn abs(self) -> Ymm {
        Ymm(_mm256_andnot_ps(_mm256_set1_ps(-0.0), self.0))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn copysign(self, sign: Ymm) -> Ymm {
        let s = _mm256_set1_ps(-0.0);
        Ymm(_mm256_or_ps(
            _mm256_andnot_ps(s, self.0),
            _mm256_and_ps(s, sign.0),
        ))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn ge(self, o: Ymm) -> __m256 {
        _mm256_cmp_ps::<_CMP_GE_OQ>(self.0, o.0)
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn select(m: __m256, a: Ymm, b: Ymm) -> Ymm {
        Ymm(_mm256_blendv_ps(b.0, a.0, m))
    }
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn bits(m: __m256) -> u32 {
        _mm256_movemask_ps(m) as u32
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn max_abs_bits(self, acc: Ymm) -> Ymm {
        let abs = _mm256_and_si256(_mm256_castps_si256(self.0), _mm256_set1_epi32(i32::MAX));
        Ymm(_mm256_castsi256_ps(_mm256_max_epi32(
            abs,
            _mm256_castps_si256(acc.0),
        )))
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store_i8(self, out: *mut u8) {
        let i = _mm256_cvttps_epi32(self.0);
        let words = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256::<1>(i));
        _mm_storel_epi64(out.cast(), _mm_packs_epi16(words, words));
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store_i8x4([a, b, c, d]: [Ymm; 4], out: *mut u8) {
        let [a, b, c, d] = [a, b, c, d].map(|r| _mm256_cvttps_epi32(r.0));
        // The packs work within 128-bit halves: bytes come out as a0-3 b0-3 c0-3 d0-3 |
        // a4-7 b4-7 c4-7 d4-7, which the permute puts back in order.
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256(out.cast(), _mm256_permutevar8x32_epi32(bytes, order));
    }
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn compress_codes(self, m: __m256, first_index: u32, out: *mut u32) -> usize {
        let bits = Self::bits(m);
        let index = _mm256_add_epi32(
            _mm256_set1_epi32(first_index as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        let sign = _mm256_and_si256(
            _mm256_castps_si256(self.0),
            _mm256_set1_epi32(SIGN_BIT as i32),
        );
        let perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(COMPRESS8[bits as usize] as i64));
        let codes = _mm256_permutevar8x32_epi32(_mm256_or_si256(index, sign), perm);
        _mm256_storeu_si256(out.cast(), codes);
        bits.count_ones() as usize
    }
}

/// Sixteen f32 lanes in a `zmm` register.
#[derive(Clone, Copy)]
pub struct Zmm(__m512);

unsafe impl Lanes for Zmm {
    const N: usize = 16;
    type Mask = __mmask16;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn splat(x: f32) -> Zmm {
        Zmm(_mm512_set1_ps(x))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const f32) -> Zmm {
        Zmm(_mm512_loadu_ps(p))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self.0)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_cells(p: *const AtomicU32) -> Zmm {
        let v: __m512;
        asm!("vmovups {v}, [{p}]", p = in(reg) p, v = out(zmm_reg) v,
            options(nostack, readonly, preserves_flags));
        Zmm(v)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_cells(self, p: *const AtomicU32) {
        asm!("vmovups [{p}], {v}", p = in(reg) p, v = in(zmm_reg) self.0,
            options(nostack, preserves_flags));
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn add(self, o: Zmm) -> Zmm {
        Zmm(_mm512_add_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn sub(self, o: Zmm) -> Zmm {
        Zmm(_mm512_sub_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn mul(self, o: Zmm) -> Zmm {
        Zmm(_mm512_mul_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn div(self, o: Zmm) -> Zmm {
        Zmm(_mm512_div_ps(self.0, o.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn sqrt(self) -> Zmm {
        Zmm(_mm512_sqrt_ps(self.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn abs(self) -> Zmm {
        Zmm(_mm512_abs_ps(self.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn copysign(self, sign: Zmm) -> Zmm {
        // Bit select: the sign bit from `sign`, the rest from `self`.
        let s = _mm512_set1_epi32(SIGN_BIT as i32);
        Zmm(_mm512_castsi512_ps(_mm512_ternarylogic_epi32::<0xCA>(
            s,
            _mm512_castps_si512(sign.0),
            _mm512_castps_si512(self.0),
        )))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn ge(self, o: Zmm) -> __mmask16 {
        _mm512_cmp_ps_mask::<_CMP_GE_OQ>(self.0, o.0)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn select(m: __mmask16, a: Zmm, b: Zmm) -> Zmm {
        Zmm(_mm512_mask_blend_ps(m, b.0, a.0))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn bits(m: __mmask16) -> u32 {
        u32::from(m)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn max_abs_bits(self, acc: Zmm) -> Zmm {
        let abs = _mm512_castps_si512(_mm512_abs_ps(self.0));
        Zmm(_mm512_castsi512_ps(_mm512_max_epi32(
            abs,
            _mm512_castps_si512(acc.0),
        )))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_i8(self, out: *mut u8) {
        let bytes = _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(self.0));
        _mm_storeu_si128(out.cast(), bytes);
    }
    #[inline]
    #[target_feature(enable = "avx512f,popcnt")]
    unsafe fn compress_codes(self, m: __mmask16, first_index: u32, out: *mut u32) -> usize {
        let index = _mm512_add_epi32(
            _mm512_set1_epi32(first_index as i32),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let sign = _mm512_and_si512(
            _mm512_castps_si512(self.0),
            _mm512_set1_epi32(SIGN_BIT as i32),
        );
        let codes = _mm512_maskz_compress_epi32(m, _mm512_or_si512(index, sign));
        _mm512_storeu_si512(out.cast(), codes);
        m.count_ones() as usize
    }
}
