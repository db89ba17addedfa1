//! Linear layers with int8 weights over a few rows: `y[r] = scale * (Q x[r]) + bias`, `Q` the
//! int8 weight `[fan_out, fan_in]` (row-major, symmetric, one scale per output channel).
//!
//! At a few rows a linear layer is a stream of its weights: int8 weights are a quarter of the
//! bytes of f32 ones, dequantized in registers (int8 -> i32 -> f32, then a fused multiply-add with
//! the f32 input), the scale applied once per output. It is `linear`'s kernel (tiles, threads,
//! the order of every sum) over `RowWeights` of another type, so a row's result does not depend
//! on the rows beside it.
//!
//! Layouts (row-major): `x [rows, fan_in]` f32, `weight [fan_out, fan_in]` i8, `scales
//! [fan_out]` f32, `bias [fan_out]` f32, `y [rows, fan_out]` f32.

use std::ops::Range;

use crate::linear::{run_checked, LinearError, RowWeights, SharedOutputs};
use crate::parallel::{ForkJoin, OnCallingThread};

/// One int8 linear layer's parameters.
pub struct Q8Weights<'a> {
    pub weight: &'a [i8],
    pub scales: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub fan_in: usize,
    pub fan_out: usize,
}

/// `y = scales * (x Q^T) + bias` on the calling thread.
pub fn linear_q8(x: &[f32], weights: &Q8Weights<'_>, y: &mut [f32]) -> Result<(), LinearError> {
    linear_q8_on(&OnCallingThread, x, weights, y)
}

/// `linear_q8` with the outputs spread over the threads of `pool`; the same bits as on one thread.
pub fn linear_q8_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    weights: &Q8Weights<'_>,
    y: &mut [f32],
) -> Result<(), LinearError> {
    run_checked(pool, x, weights, y)
}

impl RowWeights for Q8Weights<'_> {
    const BITS: usize = 8;
    fn fan_in(&self) -> usize {
        self.fan_in
    }
    fn fan_out(&self) -> usize {
        self.fan_out
    }
    fn bias(&self) -> Option<&[f32]> {
        self.bias
    }
    fn check(&self) -> Result<(), LinearError> {
        let (k, n) = (self.fan_in, self.fan_out);
        if k == 0 || self.weight.len() != n * k {
            return Err(LinearError::new(format!(
                "weight: {} values for [fan_out {n}, fan_in {k}]",
                self.weight.len()
            )));
        }
        if self.scales.len() != n {
            return Err(LinearError::new(format!("scales: {} values for fan_out {n}", self.scales.len())));
        }
        Ok(())
    }
    #[inline(always)]
    fn value(&self, o: usize, j: usize) -> f32 {
        self.weight[o * self.fan_in + j] as f32
    }
    #[inline(always)]
    fn finish(&self, o: usize, dot: f32) -> f32 {
        let scaled = dot * self.scales[o];
        self.bias.map_or(scaled, |b| scaled + b[o])
    }
    #[inline(always)]
    fn row_ptr(&self, o: usize) -> *const u8 {
        self.weight.as_ptr().wrapping_add(o * self.fan_in) as *const u8
    }
    /// Layers whose fan_in is a multiple of 16 take the AVX-512 half where the CPU has AVX-512F
    /// (`linear_q8_avx512`); others `linear`'s AVX2 tiles over `load8`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn run_outputs_avx2(&self, x: &[f32], rows: usize, outputs: Range<usize>, y: &SharedOutputs) {
        if self.fan_in.is_multiple_of(crate::linear_q8_avx512::STEP) && crate::vector::avx512_available() {
            crate::linear_q8_avx512::run_outputs(x, rows, self, outputs, y)
        } else {
            crate::linear_avx2::run_outputs(x, rows, self, outputs, y)
        }
    }
    /// Eight int8 weights widened in registers: sign-extend to i32 (`vpmovsxbd`), then to f32.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, o: usize, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let q = _mm_loadl_epi64(self.weight.as_ptr().add(o * self.fan_in + i) as *const __m128i);
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::tests::{assert_close, values, TwoParts};

    fn int8s(n: usize, seed: u32) -> Vec<i8> {
        values(n, seed).iter().map(|v| (v * 127.0).round() as i8).collect()
    }

    /// y [rows, n] in float64: each row's dot products with the int8 weights, scaled, plus bias.
    fn reference(x: &[f32], q: &[i8], scales: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f64> {
        let rows = x.len() / k;
        let mut y = vec![0.0; rows * n];
        for r in 0..rows {
            for o in 0..n {
                let dot: f64 = (0..k).map(|i| x[r * k + i] as f64 * q[o * k + i] as f64).sum();
                y[r * n + o] = dot * scales[o] as f64 + bias.map_or(0.0, |b| b[o] as f64);
            }
        }
        y
    }

    #[test]
    fn matches_a_float64_reference_of_the_dequantized_weight() {
        for (rows, k, n) in [(1, 8, 4), (3, 37, 9), (2, 256, 130), (5, 100, 7), (16, 64, 33), (37, 24, 10)] {
            let (x, q, scales, b) = (values(rows * k, 1), int8s(n * k, 2), values(n, 3), values(n, 4));
            for bias in [None, Some(b.as_slice())] {
                let mut y = vec![f32::NAN; rows * n];
                let w = Q8Weights { weight: &q, scales: &scales, bias, fan_in: k, fan_out: n };
                linear_q8(&x, &w, &mut y).unwrap();
                assert_close(&y, &reference(&x, &q, &scales, bias, k, n), k);
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_beside_other_rows_and_on_several_threads() {
        let (k, n) = (300, 1030);
        let (x, q, scales) = (values(7 * k, 5), int8s(n * k, 6), values(n, 7));
        let w = Q8Weights { weight: &q, scales: &scales, bias: None, fan_in: k, fan_out: n };
        let mut all = vec![0.0; 7 * n];
        linear_q8_on(&TwoParts, &x, &w, &mut all).unwrap();
        for r in 0..7 {
            let mut one = vec![0.0; n];
            linear_q8(&x[r * k..][..k], &w, &mut one).unwrap();
            assert_eq!(one, all[r * n..][..n], "row {r}");
        }
    }

    /// Each x86 half the CPU can run, called directly (the dispatch runs only one of them per
    /// CPU): the reference's values, and a row's bits the same alone as beside others (up to a
    /// chunk's sixteen rows: tiles of four rows, and the shorter last one).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn each_vector_half_matches_the_reference_and_keeps_a_rows_bits() {
        let mut halves = Vec::new();
        if crate::vector::avx2_fma_available() {
            halves.push("avx2");
        }
        if crate::vector::avx512_available() {
            halves.push("avx512");
        }
        let (rows, k, n) = (11, 96, 14);
        let (x, q, scales, b) = (values(rows * k, 8), int8s(n * k, 9), values(n, 10), values(n, 11));
        let w = Q8Weights { weight: &q, scales: &scales, bias: Some(&b), fan_in: k, fan_out: n };
        let want = reference(&x, &q, &scales, Some(&b), k, n);
        for name in halves {
            let run = |x: &[f32]| {
                let mut y = vec![f32::NAN; x.len() / k * n];
                let out = SharedOutputs { ptr: y.as_mut_ptr(), len: y.len() };
                // SAFETY: the CPU has the half's features; the shapes are linear_q8's checked ones.
                unsafe {
                    match name {
                        "avx2" => crate::linear_avx2::run_outputs(x, x.len() / k, &w, 0..n, &out),
                        _ => crate::linear_q8_avx512::run_outputs(x, x.len() / k, &w, 0..n, &out),
                    }
                }
                y
            };
            let all = run(&x);
            assert_close(&all, &want, k);
            for r in 0..rows {
                assert_eq!(run(&x[r * k..][..k]), all[r * n..][..n], "{name}, row {r}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors_naming_the_argument() {
        let (q, s) = (vec![0i8; 12], vec![1.0f32; 3]);
        let ok = Q8Weights { weight: &q, scales: &s, bias: None, fan_in: 4, fan_out: 3 };
        let err = |w: &Q8Weights<'_>| linear_q8(&[0.0; 4], w, &mut [0.0; 3]).unwrap_err().to_string();
        assert!(err(&Q8Weights { scales: &s[..2], ..ok }).starts_with("scales:"));
        assert!(err(&Q8Weights { weight: &q[..11], ..ok }).starts_with("weight:"));
        assert!(err(&Q8Weights { bias: Some(&[0.0; 2]), ..ok }).starts_with("bias:"));
        assert!(linear_q8(&[0.0; 5], &ok, &mut [0.0; 3]).unwrap_err().to_string().starts_with("x:"));
    }
}
