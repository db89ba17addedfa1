//! Vector helpers the kernels share: portable ones, written so that inside a function compiled for
//! AVX2 (see `attention::sequence_avx2`) they inline into 8-wide vector loops, and `avx2`'s
//! intrinsics for the kernels' AVX2 paths.

pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Eight partial sums, so the loop vectorizes without reordering a single accumulator.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        let (x, y): (&[f32; 8], &[f32; 8]) = (x.try_into().unwrap(), y.try_into().unwrap());
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        let c: &[f32; 8] = c.try_into().unwrap();
        for i in 0..8 {
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

/// Horizontal sums with AVX2 intrinsics. Safety: callers run on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    /// The sum of v's eight lanes.
    #[inline(always)]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// Lane i of the result is the sum of v[i]'s eight lanes: eight horizontal sums in seven
    /// adds, where eight `hsum`s take twenty-four.
    #[inline(always)]
    pub unsafe fn hsum8(v: &[__m256; 8]) -> __m256 {
        let a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        let b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        // a holds v0..v3's sums over lanes 0-3 in its low half and over lanes 4-7 in its high half
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b))
    }
}
