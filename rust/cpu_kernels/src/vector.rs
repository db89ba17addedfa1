//! What the kernels share: the one way a kernel picks its AVX2 half, the portable vector helpers,
//! `exp` with its constants, and (`avx2`) the intrinsics helpers.
//!
//! Each kernel is a pair of files, `k.rs` and `k_avx2.rs`, and one function of `k.rs` dispatches
//! (`attention::run_sequences`, `lora::run_blocks`), in this shape:
//!
//! ```text
//! fn run(args) {
//!     #[cfg(target_arch = "x86_64")]
//!     if crate::vector::avx2_fma_available() {
//!         // SAFETY: the CPU has AVX2 and FMA; <what else the AVX2 half relies on>.
//!         return unsafe { crate::k_avx2::run(args) };
//!     }
//!     run_portable(args)
//! }
//! ```
//!
//! `linear_q8` has a third file, `linear_q8_avx512.rs`: its AVX2 entry hands a layer to it where
//! the CPU has AVX-512F (an int8 layer at 32 rows is bound by its tiles' register blocking); the
//! same rules hold there. `linear_q4`'s dispatch is its own (`linear_q4::run_outputs`): its
//! AVX2 half takes quantized activations, not `RowWeights`' f32 rows.
//!
//! `k_avx2::run` is the pair's only `#[target_feature(enable = "avx2,fma")]` function (`linear_avx2`
//! and `linear_kquant_avx2` also build their tiles once more with AVX-512VL enabled: the same
//! 8-lane instructions, given 32 registers, for passes over more rows). Everything
//! it calls is `#[inline(always)]`, so it is compiled into it with AVX2 and FMA, the portable
//! helpers here included: their loops become 8-wide vector loops there. A closure is not: it is a
//! function of its own, with no more target features than the function it is written in, so its
//! intrinsics may compile to calls and its loops to scalar code. Hence, in everything an AVX2
//! half runs, intrinsics and the loops meant to vectorize are never written in closures; closures
//! there do only scalar work (tails, page offsets).

/// f32 lanes of an AVX2 vector. The portable helpers keep this many partial sums, so that
/// compiled for AVX2 each set of them is one vector.
pub const LANES: usize = 8;

/// Whether the AVX2 half of a kernel may run: the CPU has AVX2 and FMA (std caches the answer).
#[cfg(target_arch = "x86_64")]
pub fn avx2_fma_available() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// Whether AVX2 code may also use the 32 vector registers of AVX-512VL (`linear`'s wider tiles).
#[cfg(target_arch = "x86_64")]
pub fn avx512vl_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512vl")
}

/// Whether AVX2 code may also use AVX-512VL's registers and VNNI's `vpdpwssd` on 8-lane vectors
/// (the int16-activation kernels' tiles of several rows).
#[cfg(target_arch = "x86_64")]
pub fn avx512vl_vnni_available() -> bool {
    avx512vl_available() && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Whether AVX2 code may also use AVX-512BW's byte masks on 8-lane vectors (`linear_q5_avx2`).
#[cfg(target_arch = "x86_64")]
pub fn avx512bw_available() -> bool {
    avx512vl_available() && std::arch::is_x86_feature_detected!("avx512bw")
}

/// Whether a kernel's AVX-512 half may run (`linear_q8` has one): the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
pub fn avx512_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// `LANES` partial sums, so the loop vectorizes without reordering a single accumulator.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        let (x, y): (&[f32; LANES], &[f32; LANES]) = (x.try_into().unwrap(), y.try_into().unwrap());
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `dot` of f16 values with f32 ones (each widened exactly).
#[inline(always)]
pub fn dot_f16(a: &[half::f16], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x.to_f32() * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i].to_f32() * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        let c: &[f32; LANES] = c.try_into().unwrap();
        for i in 0..LANES {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
pub fn axpy(p: f32, v: &[f32], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(v) {
        *o += p * x;
    }
}

// Cephes' expf, for `exp` and `avx2::exp8` alike: x = n ln 2 + r with |r| <= ln 2 / 2, ln 2 in two
// parts (`LN2_HI` has few mantissa bits, so n * LN2_HI is exact), a degree-6 polynomial for e^r,
// 2^n built from the exponent bits.
/// About where e^x leaves f32's normal range; `exp` clamps its argument to it.
const EXP_MIN: f32 = -87.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// e^r = 1 + r + r^2 p(r), p's coefficients from the highest power down (Horner's order).
const EXP_POLY: [f32; 6] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
/// f32's exponent bias and the position of its exponent field.
const F32_EXP_BIAS: i32 = 127;
const F32_EXP_SHIFT: u32 = f32::MANTISSA_DIGITS - 1;

/// e^x for x <= 0 (a softmax's shifted scores), relative error under 3e-7. Branch-free, so a loop
/// over it vectorizes, where libm's expf is a call per element. Below `EXP_MIN` it returns
/// e^EXP_MIN, negligible next to the row's largest weight, 1.
/// `x.round_ties_even()` for |x| < 2^22, without the call to libm's `rintf` it compiles to when
/// SSE4.1 is not a target feature (the activation quantizers round ~100k values a token): adding
/// and subtracting 1.5 * 2^23 leaves x's integer part in the mantissa, rounded to nearest even.
#[inline(always)]
pub fn round_ties_even_small(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + SHIFT) - SHIFT
}

#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, 0.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let [c0, c1, c2, c3, c4, c5] = EXP_POLY;
    let p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5;
    let y = p * r * r + r + 1.0;
    y * f32::from_bits(((n as i32 + F32_EXP_BIAS) as u32) << F32_EXP_SHIFT)
}

/// Intrinsics helpers for the kernels' AVX2 halves. Safety: callers run on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    use super::{EXP_MIN, EXP_POLY, F32_EXP_BIAS, F32_EXP_SHIFT, LANES, LN2_HI, LN2_LO};

    /// The sum of v's lanes.
    #[inline(always)]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// Lane i of the result is the sum of v[i]'s lanes: eight horizontal sums in seven adds, where
    /// eight `hsum`s take twenty-four.
    #[inline(always)]
    pub unsafe fn hsum8(v: &[__m256; LANES]) -> __m256 {
        let a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        let b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        // a holds v0..v3's sums over lanes 0-3 in its low half and over lanes 4-7 in its high half
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b))
    }

    /// The first `n` (at most eight) f16 values at `p` widened to f32 lanes, the lanes past `n`
    /// zero; nothing past p + n is read. Safety: the CPU also has F16C.
    #[inline(always)]
    pub unsafe fn load_f16(p: *const half::f16, n: usize) -> __m256 {
        if n >= LANES {
            return _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        }
        let p = p as *const u16;
        let mut v = _mm_setzero_si128();
        macro_rules! lane {
            ($i:literal) => {
                if n > $i {
                    v = _mm_insert_epi16::<$i>(v, *p.add($i) as i32);
                }
            };
        }
        lane!(0);
        lane!(1);
        lane!(2);
        lane!(3);
        lane!(4);
        lane!(5);
        lane!(6);
        _mm256_cvtph_ps(v)
    }

    /// The first `n` (at most eight) f32 values at `p`, the lanes past `n` zero (a masked load:
    /// nothing past p + n is read).
    #[inline(always)]
    pub unsafe fn load_f32(p: *const f32, n: usize) -> __m256 {
        if n >= LANES {
            return _mm256_loadu_ps(p);
        }
        const MASKS: [i32; 2 * LANES] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];
        _mm256_maskload_ps(p, _mm256_loadu_si256(MASKS.as_ptr().add(LANES - n) as *const __m256i))
    }

    /// `super::exp` on each lane: the same steps, with fused multiply-adds.
    #[inline(always)]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)), _mm256_setzero_ps());
        let log2e = _mm256_set1_ps(std::f32::consts::LOG2_E);
        let n = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.5)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0));
        let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(F32_EXP_BIAS));
        _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<{ F32_EXP_SHIFT as i32 }>(biased)))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_within_a_few_ulp_of_libm_over_the_softmax_range() {
        let mut worst = 0.0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (super::exp(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(-1000.0) < 1e-37);
    }

    #[test]
    fn round_ties_even_small_is_round_ties_even_below_2_to_the_22() {
        let halves = (-70_000..=70_000).map(|i| i as f32 * 0.5);
        let spread = (0..200_000).map(|i| (i as f32 * 0.6180339).sin() * 4_000_000.0);
        for x in halves.chain(spread).chain([0.49999997, -0.49999997, 32767.5, -32767.5, 4_194_303.5]) {
            // equal as values (-0.5 gives +0.0, not -0.0: the same integer once converted)
            assert_eq!(super::round_ties_even_small(x), x.round_ties_even(), "x = {x}");
        }
    }
}
