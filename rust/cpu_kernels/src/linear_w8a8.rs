//! Linear layers with int8 weights and int8 activations over a few rows (w8a8): each row of `x` is
//! quantized as a weight row is (symmetric: `sx = max(max |x|, f32::MIN_POSITIVE) / 127`, values
//! `x / sx` rounded half to even, clamped to +-127), the int8 products are summed exactly in i32,
//! and `y = (sum as f32 * sx) * scale + bias`. Integer sums have no order, so a row gets the same
//! bits on any number of threads, beside any rows, and as `torch._int_mm` followed by the same
//! three float operations (pyserve's `W8A8Linear` on more rows).
//!
//! With AVX-512 VNNI the sums run on `vpdpbusd` (unsigned x signed bytes, four products a lane):
//! each row is stored shifted to `xq + 128` (0..255), and 128 times each weight row's sum is
//! taken off at the end. Elsewhere a plain i32 loop (the pyserve engine serves w8a8 only where
//! the CPU has VNNI; the loop keeps the kernel's meaning on every CPU).
//!
//! Layouts (row-major): `x [rows, fan_in]` f32, `weight [fan_out, fan_in]` i8, `scales
//! [fan_out]` f32, `bias [fan_out]` f32, `y [rows, fan_out]` f32.

use std::ops::Range;

use crate::linear::{check_rows, for_output_ranges, LinearError, RowWeights, SharedOutputs};
use crate::linear_q8::Q8Weights;
use crate::parallel::{ForkJoin, OnCallingThread};
use crate::vector::round_ties_even_small;

/// One w8a8 linear layer's parameters: int8's weights (its activations are quantized per call).
pub struct W8A8Weights<'a> {
    pub weight: &'a [i8],
    pub scales: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub fan_in: usize,
    pub fan_out: usize,
}

/// `y = ((xq Q^T) * sx) * scales + bias` on the calling thread.
pub fn linear_w8a8(x: &[f32], weights: &W8A8Weights<'_>, y: &mut [f32]) -> Result<(), LinearError> {
    linear_w8a8_on(&OnCallingThread, x, weights, y)
}

/// `linear_w8a8` with the outputs spread over the threads of `pool`; the same bits as on one thread.
pub fn linear_w8a8_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    weights: &W8A8Weights<'_>,
    y: &mut [f32],
) -> Result<(), LinearError> {
    let rows = check(x, weights, y)?;
    let quantized = QuantizedRows::of(x, rows, weights.fan_in);
    let n = weights.fan_out;
    let out = SharedOutputs { ptr: y.as_mut_ptr(), len: y.len() };
    for_output_ranges(pool, n, rows * weights.fan_in * n, &|outputs| {
        run_outputs(&quantized, weights, outputs, &out)
    });
    Ok(())
}

/// The arrays' sizes checked as int8's (the same weights) and the step's; returns the rows.
fn check(x: &[f32], w: &W8A8Weights<'_>, y: &[f32]) -> Result<usize, LinearError> {
    let q8 =
        Q8Weights { weight: w.weight, scales: w.scales, bias: w.bias, fan_in: w.fan_in, fan_out: w.fan_out };
    q8.check()?;
    check_rows(x, w.fan_in, w.fan_out, w.bias, y)
}

/// Bytes of a row's quantized values one VNNI step takes.
const STEP: usize = 64;
/// The shift that makes a quantized value an unsigned byte.
const SHIFT: i32 = 128;

/// Each row of x quantized: `xq + 128` as bytes, every row padded to a whole number of steps
/// with 128 (a quantized 0), and its scale.
struct QuantizedRows {
    values: Vec<u8>,
    scales: Vec<f32>,
    stride: usize,
    rows: usize,
    fan_in: usize,
}

impl QuantizedRows {
    fn of(x: &[f32], rows: usize, fan_in: usize) -> Self {
        let stride = fan_in.next_multiple_of(STEP);
        let mut values = vec![SHIFT as u8; rows * stride];
        let mut scales = Vec::with_capacity(rows);
        for (row, out) in x.chunks_exact(fan_in).zip(values.chunks_exact_mut(stride)) {
            let scale = row.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE) / 127.0;
            for (q, v) in out.iter_mut().zip(row) {
                // |v / scale| <= 127 (scale is the row's largest |v| / 127)
                *q = (round_ties_even_small(v / scale).clamp(-127.0, 127.0) as i32 + SHIFT) as u8;
            }
            scales.push(scale);
        }
        Self { values, scales, stride, rows, fan_in }
    }

    fn row(&self, r: usize) -> &[u8] {
        &self.values[r * self.stride..][..self.stride]
    }
}

impl W8A8Weights<'_> {
    #[inline(always)]
    fn finish(&self, o: usize, sum: i32, x_scale: f32) -> f32 {
        let y = (sum as f32 * x_scale) * self.scales[o];
        self.bias.map_or(y, |b| y + b[o])
    }
}

/// Columns `outputs` of every row, on the calling thread.
fn run_outputs(x: &QuantizedRows, w: &W8A8Weights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    #[cfg(target_arch = "x86_64")]
    if vnni::available() {
        // SAFETY: the CPU has AVX-512F, BW and VNNI; x's rows are padded to whole steps and the
        // weights' shape was checked.
        return unsafe { vnni::run_outputs(x, w, outputs, y) };
    }
    plain_outputs(x, w, outputs, y)
}

/// `run_outputs` without VNNI.
fn plain_outputs(x: &QuantizedRows, w: &W8A8Weights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    let k = x.fan_in;
    for o in outputs {
        let weights = &w.weight[o * k..][..k];
        for r in 0..x.rows {
            let sum: i32 =
                x.row(r)[..k].iter().zip(weights).map(|(&q, &v)| (q as i32 - SHIFT) * v as i32).sum();
            // SAFETY: this call's range of outputs is its own.
            unsafe { y.set(r * w.fan_out + o, w.finish(o, sum, x.scales[r])) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    //! `vpdpbusd` over tiles of four weight rows by up to four input rows: each step loads 64
    //! bytes of every weight row once for all the rows, sixteen i32 sums of four products a lane,
    //! and prefetches the same bytes of the next tile's rows.

    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{QuantizedRows, W8A8Weights, SHIFT, STEP};
    use crate::linear::{SharedOutputs, TILE_OUTPUTS};

    /// Input rows a tile's pass computes at once: with TILE_OUTPUTS, sixteen sums in registers.
    const TILE_ROWS: usize = 4;

    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }

    /// Safety: AVX-512F, BW and VNNI; shapes checked, x's rows padded to whole steps.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn run_outputs(
        x: &QuantizedRows,
        w: &W8A8Weights<'_>,
        outputs: Range<usize>,
        y: &SharedOutputs,
    ) {
        let mut o = outputs.start;
        while o < outputs.end {
            let width = TILE_OUTPUTS.min(outputs.end - o);
            // A narrow tile repeats its last weight row (its sums are not written).
            let first: [usize; TILE_OUTPUTS] = std::array::from_fn(|i| o + i.min(width - 1));
            let mut r = 0;
            while r < x.rows {
                match x.rows - r {
                    1 => tile::<1>(x, w, first, width, r, y),
                    2 => tile::<2>(x, w, first, width, r, y),
                    3 => tile::<3>(x, w, first, width, r, y),
                    _ => tile::<TILE_ROWS>(x, w, first, width, r, y),
                }
                r += TILE_ROWS;
            }
            o += width;
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const R: usize>(
        x: &QuantizedRows,
        w: &W8A8Weights<'_>,
        outputs: [usize; TILE_OUTPUTS],
        width: usize,
        r0: usize,
        y: &SharedOutputs,
    ) {
        let k = w.fan_in;
        let weights: [*const i8; TILE_OUTPUTS] = outputs.map(|o| w.weight.as_ptr().add(o * k));
        let inputs: [*const u8; R] = std::array::from_fn(|r| x.row(r0 + r).as_ptr());
        let ones = _mm512_set1_epi8(1);
        // The next tile's weight rows, a cache line of each per step (no fault past the end).
        let ahead = TILE_OUTPUTS * k;
        let mut sums = [[_mm512_setzero_si512(); R]; TILE_OUTPUTS];
        let mut weight_sums = [_mm512_setzero_si512(); TILE_OUTPUTS];
        for at in (0..k).step_by(STEP) {
            let mask: __mmask64 = if at + STEP <= k { !0 } else { (1u64 << (k - at)) - 1 };
            let ws: [__m512i; TILE_OUTPUTS] = weights.map(|p| _mm512_maskz_loadu_epi8(mask, p.add(at)));
            for p in weights {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at + ahead));
            }
            for (s, v) in weight_sums.iter_mut().zip(&ws) {
                *s = _mm512_dpbusd_epi32(*s, ones, *v);
            }
            for (r, input) in inputs.iter().enumerate() {
                let xv = _mm512_loadu_si512(input.add(at) as *const __m512i);
                for (row_sums, v) in sums.iter_mut().zip(&ws) {
                    row_sums[r] = _mm512_dpbusd_epi32(row_sums[r], xv, *v);
                }
            }
        }
        for ((&o, row_sums), weight_sum) in outputs.iter().zip(&sums).zip(weight_sums).take(width) {
            let correction = SHIFT * _mm512_reduce_add_epi32(weight_sum);
            for (r, &s) in row_sums.iter().enumerate() {
                let sum = _mm512_reduce_add_epi32(s) - correction;
                y.set((r0 + r) * w.fan_out + o, w.finish(o, sum, x.scales[r0 + r]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::tests::{values, TwoParts};

    fn int8s(n: usize, seed: u32) -> Vec<i8> {
        values(n, seed).iter().map(|v| (v * 127.0).round() as i8).collect()
    }

    /// y [rows, n]: each row quantized by the rule above, its sums in i64, the same float steps.
    fn reference(x: &[f32], q: &[i8], scales: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
        let rows = x.len() / k;
        let mut y = vec![0.0; rows * n];
        for r in 0..rows {
            let row = &x[r * k..][..k];
            let sx = row.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE) / 127.0;
            let xq: Vec<i64> =
                row.iter().map(|v| (v / sx).round_ties_even().clamp(-127.0, 127.0) as i64).collect();
            for o in 0..n {
                let sum: i64 = (0..k).map(|i| xq[i] * q[o * k + i] as i64).sum();
                let v = (sum as f32 * sx) * scales[o];
                y[r * n + o] = bias.map_or(v, |b| v + b[o]);
            }
        }
        y
    }

    #[test]
    fn equals_a_reference_with_exact_sums_bit_for_bit() {
        let shapes =
            [(1, 8, 4), (3, 37, 9), (2, 256, 130), (5, 100, 7), (16, 64, 33), (7, 200, 13), (37, 24, 10)];
        for (rows, k, n) in shapes {
            // rows of very different magnitudes: each has a scale of its own
            let x: Vec<f32> =
                values(rows * k, 1).iter().enumerate().map(|(i, v)| v * (1 + i / k) as f32).collect();
            let (q, scales, b) = (int8s(n * k, 2), values(n, 3), values(n, 4));
            for bias in [None, Some(b.as_slice())] {
                let w = W8A8Weights { weight: &q, scales: &scales, bias, fan_in: k, fan_out: n };
                let mut y = vec![f32::NAN; rows * n];
                linear_w8a8(&x, &w, &mut y).unwrap();
                assert_eq!(y, reference(&x, &q, &scales, bias, k, n), "rows {rows} k {k} n {n}");
                let mut alone = vec![f32::NAN; n];
                linear_w8a8(&x[(rows - 1) * k..], &w, &mut alone).unwrap();
                assert_eq!(alone, y[(rows - 1) * n..], "the last row alone");
                let mut split = vec![f32::NAN; rows * n];
                linear_w8a8_on(&TwoParts, &x, &w, &mut split).unwrap();
                assert_eq!(split, y, "on two threads");
                let mut plain = vec![f32::NAN; rows * n];
                let out = SharedOutputs { ptr: plain.as_mut_ptr(), len: plain.len() };
                plain_outputs(&QuantizedRows::of(&x, rows, k), &w, 0..n, &out);
                assert_eq!(plain, y, "the plain loop (without VNNI)");
            }
        }
    }

    #[test]
    fn extreme_values_do_not_overflow_and_a_zero_row_stays_zero() {
        let (k, n) = (4096, 8);
        let q = vec![-128i8; n * k]; // a checkpoint's int8 may reach -128
        let x: Vec<f32> = (0..2 * k).map(|i| if i < k { 3.0 } else { 0.0 }).collect(); // every product 127 x -128
        let scales = vec![1.0f32; n];
        let w = W8A8Weights { weight: &q, scales: &scales, bias: None, fan_in: k, fan_out: n };
        let mut y = vec![f32::NAN; 2 * n];
        linear_w8a8(&x, &w, &mut y).unwrap();
        assert_eq!(y, reference(&x, &q, &scales, None, k, n));
        assert!(y[n..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn shapes_are_checked_naming_the_array() {
        let (q, scales) = (vec![0i8; 12], vec![1.0f32; 3]);
        let w = W8A8Weights { weight: &q, scales: &scales, bias: None, fan_in: 4, fan_out: 3 };
        let err = linear_w8a8(&[0.0; 5], &w, &mut [0.0; 3]).unwrap_err();
        assert!(err.to_string().starts_with("x: 5 values"), "{err}");
        let short = W8A8Weights { scales: &scales[..2], ..w };
        assert!(linear_w8a8(&[0.0; 4], &short, &mut [0.0; 3])
            .unwrap_err()
            .to_string()
            .starts_with("scales: 2"));
    }
}
