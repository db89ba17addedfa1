//! Linear layers with 4-bit weights over a few rows: `linear`'s kernel over weights packed two
//! to a byte, asymmetric in groups of `group` along fan_in: weight (o, j) = q * scale + offset,
//! q in 0..16, with one scale and one offset (-zero * scale) per row and group.
//!
//! Layouts (row-major): `packed [fan_out, fan_in / 2]` u8 (weight 2j in the low nibble of byte j,
//! 2j + 1 in the high one), `scales`, `offsets [fan_out, fan_in / group]` f32, `x [rows, fan_in]`,
//! `bias [fan_out]`, `y [rows, fan_out]` f32. `group` is a multiple of 8 dividing fan_in.

use std::ops::Range;

use crate::linear::{run_checked, LinearError, RowWeights, SharedOutputs};
use crate::parallel::{ForkJoin, OnCallingThread};

/// One 4-bit linear layer's parameters.
pub struct Q4Weights<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [f32],
    pub offsets: &'a [f32],
    pub group: usize,
    pub bias: Option<&'a [f32]>,
    pub fan_in: usize,
    pub fan_out: usize,
}

/// `y = x W^T + bias` with W dequantized in registers, on the calling thread.
pub fn linear_q4(x: &[f32], weights: &Q4Weights<'_>, y: &mut [f32]) -> Result<(), LinearError> {
    linear_q4_on(&OnCallingThread, x, weights, y)
}

/// `linear_q4` with the outputs spread over the threads of `pool`; the same bits as on one thread.
pub fn linear_q4_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    weights: &Q4Weights<'_>,
    y: &mut [f32],
) -> Result<(), LinearError> {
    run_checked(pool, x, weights, y)
}

impl Q4Weights<'_> {
    /// The (scale, offset) index of weight (o, j); `group` is a power of two (checked), so no
    /// division runs per weight.
    #[inline(always)]
    fn group_of(&self, o: usize, j: usize) -> usize {
        let shift = self.group.trailing_zeros();
        (o * self.fan_in + j) >> shift
    }
}

impl RowWeights for Q4Weights<'_> {
    const BITS: usize = 4;
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
        let (k, n, g) = (self.fan_in, self.fan_out, self.group);
        if g < 8 || !g.is_power_of_two() || k % g != 0 {
            return Err(LinearError::new(format!(
                "group: {g} must be a power of two of at least 8 dividing fan_in {k}"
            )));
        }
        if self.packed.len() != n * k / 2 {
            return Err(LinearError::new(format!(
                "packed: {} bytes for [fan_out {n}, fan_in {k}] at two weights a byte",
                self.packed.len()
            )));
        }
        for (name, v) in [("scales", self.scales), ("offsets", self.offsets)] {
            if v.len() != n * (k / g) {
                return Err(LinearError::new(format!(
                    "{name}: {} values for [fan_out {n}, {} groups]",
                    v.len(),
                    k / g
                )));
            }
        }
        Ok(())
    }
    #[inline(always)]
    fn value(&self, o: usize, j: usize) -> f32 {
        let byte = self.packed[(o * self.fan_in + j) / 2];
        let q = (byte >> (4 * (j % 2))) & 0xF;
        let g = self.group_of(o, j);
        q as f32 * self.scales[g] + self.offsets[g]
    }
    #[inline(always)]
    fn finish(&self, o: usize, dot: f32) -> f32 {
        self.bias.map_or(dot, |b| dot + b[o])
    }
    /// Groups of 16 inputs or more take the kernel that applies each scale once per group
    /// (`linear_q4_avx2`), or its AVX-512 twin for groups of 32 or more where the CPU has
    /// AVX-512F (`linear_q4_avx512`).
    #[cfg(target_arch = "x86_64")]
    unsafe fn run_outputs_avx2(&self, x: &[f32], rows: usize, outputs: Range<usize>, y: &SharedOutputs) {
        if self.group >= crate::linear_q4_avx512::STEP && crate::vector::avx512_available() {
            crate::linear_q4_avx512::run_outputs(x, rows, self, outputs, y)
        } else if self.group >= 16 {
            crate::linear_q4_avx2::run_outputs(x, rows, self, outputs, y)
        } else {
            crate::linear_avx2::run_outputs(x, rows, self, outputs, y)
        }
    }
    #[inline(always)]
    fn row_ptr(&self, o: usize) -> *const u8 {
        self.packed.as_ptr().wrapping_add(o * self.fan_in / 2)
    }
    /// Eight 4-bit weights (four bytes) spread one to a lane by variable shifts, masked,
    /// widened to f32 and dequantized with one fused multiply-add (i is a multiple of 8, so the
    /// eight share a group).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(&self, o: usize, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let word = (self.packed.as_ptr().add((o * self.fan_in + i) / 2) as *const i32).read_unaligned();
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(0xF));
        let g = self.group_of(o, i);
        _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(q),
            _mm256_set1_ps(self.scales[g]),
            _mm256_set1_ps(self.offsets[g]),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::tests::{assert_close, values, TwoParts};

    fn nibbles(n: usize, seed: u32) -> Vec<u8> {
        values(n, seed).iter().map(|v| ((v + 1.0) * 7.5).round() as u8 & 0xF).collect()
    }

    fn pack(q: &[u8]) -> Vec<u8> {
        q.chunks(2).map(|p| p[0] | (p[1] << 4)).collect()
    }

    /// y [rows, n] in float64 from the dequantized weights: `q` the unpacked nibbles, `w` the
    /// layer's scales, offsets, bias and shape (its packed bytes are not read).
    fn reference(x: &[f32], q: &[u8], w: &Q4Weights<'_>) -> Vec<f64> {
        let (k, n, group) = (w.fan_in, w.fan_out, w.group);
        let (scales, offsets, bias) = (w.scales, w.offsets, w.bias);
        let (rows, groups) = (x.len() / k, k / group);
        let mut y = vec![0.0; rows * n];
        for r in 0..rows {
            for o in 0..n {
                let dot: f64 = (0..k)
                    .map(|j| {
                        let g = o * groups + j / group;
                        x[r * k + j] as f64 * (q[o * k + j] as f64 * scales[g] as f64 + offsets[g] as f64)
                    })
                    .sum();
                y[r * n + o] = dot + bias.map_or(0.0, |b| b[o] as f64);
            }
        }
        y
    }

    #[test]
    fn matches_a_float64_reference_of_the_dequantized_weight() {
        for (rows, k, n, group) in [
            (1, 64, 4, 32),
            (3, 128, 9, 64),
            (2, 256, 130, 128),
            (17, 64, 7, 8),
            (2, 96, 5, 32),
            (5, 48, 11, 16),
        ] {
            let groups = k / group;
            let (x, q, b) = (values(rows * k, 1), nibbles(n * k, 2), values(n, 3));
            let (scales, offsets) = (values(n * groups, 4), values(n * groups, 5));
            let packed = pack(&q);
            for bias in [None, Some(b.as_slice())] {
                let w = Q4Weights {
                    packed: &packed,
                    scales: &scales,
                    offsets: &offsets,
                    group,
                    bias,
                    fan_in: k,
                    fan_out: n,
                };
                let mut y = vec![f32::NAN; rows * n];
                linear_q4(&x, &w, &mut y).unwrap();
                assert_close(&y, &reference(&x, &q, &w), k);
            }
        }
    }

    /// Each x86 half the CPU can run, called directly (the dispatch runs only one of them per
    /// CPU): the reference's values, and a row's bits the same alone as beside six others.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn each_vector_half_matches_the_reference_and_keeps_a_rows_bits() {
        type Half = unsafe fn(&[f32], usize, &Q4Weights<'_>, Range<usize>, &SharedOutputs);
        let mut halves: Vec<(&str, Half)> = Vec::new();
        if crate::vector::avx2_fma_available() {
            halves.push(("avx2", crate::linear_q4_avx2::run_outputs));
        }
        if crate::vector::avx512_available() {
            halves.push(("avx512", crate::linear_q4_avx512::run_outputs));
        }
        let (rows, k, n, group) = (7, 256, 13, 64);
        let (x, q) = (values(rows * k, 10), nibbles(n * k, 11));
        let (scales, offsets) = (values(n * k / group, 12), values(n * k / group, 13));
        let packed = pack(&q);
        let w = Q4Weights {
            packed: &packed,
            scales: &scales,
            offsets: &offsets,
            group,
            bias: None,
            fan_in: k,
            fan_out: n,
        };
        let want = reference(&x, &q, &w);
        for (name, half) in halves {
            let run = |x: &[f32]| {
                let mut y = vec![f32::NAN; x.len() / k * n];
                let out = SharedOutputs { ptr: y.as_mut_ptr(), len: y.len() };
                // SAFETY: the CPU has the half's features; the shapes are linear_q4's checked ones.
                unsafe { half(x, x.len() / k, &w, 0..n, &out) };
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
    fn a_row_gets_the_same_bits_alone_beside_other_rows_and_on_several_threads() {
        let (k, n, group) = (256, 1030, 64);
        let (x, packed) = (values(7 * k, 6), pack(&nibbles(n * k, 7)));
        let (scales, offsets) = (values(n * k / group, 8), values(n * k / group, 9));
        let w = Q4Weights {
            packed: &packed,
            scales: &scales,
            offsets: &offsets,
            group,
            bias: None,
            fan_in: k,
            fan_out: n,
        };
        let mut all = vec![0.0; 7 * n];
        linear_q4_on(&TwoParts, &x, &w, &mut all).unwrap();
        for r in 0..7 {
            let mut one = vec![0.0; n];
            linear_q4(&x[r * k..][..k], &w, &mut one).unwrap();
            assert_eq!(one, all[r * n..][..n], "row {r}");
        }
    }

    #[test]
    fn bad_shapes_and_groups_are_errors_naming_the_argument() {
        let (packed, s) = (vec![0u8; 3 * 32], vec![1.0f32; 6]);
        let ok = Q4Weights {
            packed: &packed,
            scales: &s,
            offsets: &s,
            group: 32,
            bias: None,
            fan_in: 64,
            fan_out: 3,
        };
        let err = |w: &Q4Weights<'_>| linear_q4(&[0.0; 64], w, &mut [0.0; 3]).unwrap_err().to_string();
        assert!(err(&Q4Weights { group: 48, ..ok }).starts_with("group:"));
        assert!(err(&Q4Weights { group: 4, ..ok }).starts_with("group:"));
        assert!(err(&Q4Weights { packed: &packed[..95], ..ok }).starts_with("packed:"));
        assert!(err(&Q4Weights { scales: &s[..5], ..ok }).starts_with("scales:"));
        assert!(err(&Q4Weights { offsets: &s[..5], ..ok }).starts_with("offsets:"));
        assert!(linear_q4(&[0.0; 64], &ok, &mut [0.0; 3]).is_ok());
    }
}
