//! Linear layers with 4-bit weights over a few rows: `linear`'s kernel over weights packed two
//! to a byte, asymmetric in groups of `group` along fan_in: weight (o, j) = q * scale + offset,
//! q in 0..16, with one scale and one offset (-zero * scale) per row and group.
//!
//! Groups of 32 inputs or more (every group pyserve quantizes to; a GGUF file's Q4_0 / Q4_1
//! blocks are read in place by `linear_q4_blocks`, in the same arithmetic) run on
//! int16 activations: each row of x is quantized once per call in blocks of 32 inputs (`sx =
//! max(max |x|, f32::MIN_POSITIVE) / 32767` per block, `x / sx` rounded half to even), the
//! products q * xq are summed exactly in i32 per block (at most 32 * 15 * 32767 < 2^24), and
//! output o of row r is `sum_blocks (isum * sx) * scale[o, g] + sum_g offset[o, g] * xsum[r, g]`,
//! xsum the f32 sum of the group's inputs. Widening nibbles to f32 bounds a 4-bit layer by its
//! vector instructions (~16 GB/s of weights at one row on two AVX2 cores); integer products read
//! them at the memory's speed. int8 activations (llama.cpp's for its 4-bit files) would take one
//! instruction fewer per block but cost a small model its quality: SmolLM2-135M's top-1
//! agreement with transformers fell from 0.985 to 0.943 on them; at int16 the step is 1/65534 of
//! a block's largest value. Smaller groups (8, 16) take `linear`'s f32 kernel over the widened
//! weights.
//!
//! Every output is summed in one fixed order whatever the rows beside it, the tile it falls in
//! or the thread: a row gets the same bits alone or in a batch.
//!
//! Layouts (row-major): `packed [fan_out, fan_in / 2]` u8 (weight 2j in the low nibble of byte j,
//! 2j + 1 in the high one), `scales`, `offsets [fan_out, fan_in / group]` f16 (as GGUF's Q4_0
//! and Q4_1 store theirs; f32 would make a group of 32 weights 24 bytes instead of 20), `x [rows, fan_in]`,
//! `bias [fan_out]`, `y [rows, fan_out]` f32. `group` is a power of two of at least 8 dividing
//! fan_in.

use std::ops::Range;

use half::f16;

use crate::linear::{
    check_rows, for_output_ranges, run_checked, LinearError, RowWeights, SharedOutputs, CHUNK_ROWS,
};
use crate::parallel::{ForkJoin, OnCallingThread};
use crate::vector::{round_ties_even_small, sum};

/// Inputs of a block of quantized activations: sixteen bytes of packed weights.
pub(crate) const BLOCK: usize = 32;

/// One 4-bit linear layer's parameters.
pub struct Q4Weights<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [f16],
    pub offsets: &'a [f16],
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
    if !weights.group.is_multiple_of(BLOCK) {
        return run_checked(pool, x, weights, y);
    }
    weights.check()?;
    let (k, n) = (weights.fan_in, weights.fan_out);
    check_rows(x, k, n, weights.bias, y)?;
    // A pass over the weights per CHUNK_ROWS rows: their quantized inputs stay in the cache.
    for (xs, ys) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
        let quantized = QuantizedBlocks::of(xs, k, weights.group);
        let out = SharedOutputs { ptr: ys.as_mut_ptr(), len: ys.len() };
        for_output_ranges(pool, n, quantized.rows * k * n, &|outputs| {
            run_outputs(&quantized, weights, outputs, &out)
        });
    }
    Ok(())
}

/// The largest quantized activation.
const X_MAX: f32 = 32767.0;
/// Inputs of a pair of blocks: what one step of the AVX2 half multiplies (32 bytes of nibbles).
pub(crate) const PAIR: usize = 2 * BLOCK;
/// Scales stored per pair: each block's, once for each of the four i32 lanes its sums land in.
pub(crate) const PAIR_SCALES: usize = 8;

/// A call's rows of x as the integer products take them: each block of 32 inputs quantized to
/// int16 with a scale of its own, and each group's f32 sum. A row is stored in pairs of blocks
/// (the last one padded with zeros), pair t's 64 inputs as four runs of sixteen: run c holds
/// inputs 64t + 4i + c, i = 0..16, the order in which the AVX2 half widens 32 bytes of nibbles
/// (sixteen u16 lanes, each shifted by 4c). Its scales are stored eight to a pair: block 2t's
/// four times, then block 2t + 1's (zero past the row's end).
pub(crate) struct QuantizedBlocks {
    pub values: Vec<i16>,
    pub scales: Vec<f32>,
    pub group_sums: Vec<f32>,
    pub rows: usize,
    pub pairs: usize,
}

impl QuantizedBlocks {
    pub(crate) fn of(x: &[f32], fan_in: usize, group: usize) -> Self {
        let rows = x.len() / fan_in;
        let pairs = fan_in.div_ceil(PAIR);
        let mut values = vec![0i16; rows * pairs * PAIR];
        let mut scales = vec![0.0f32; rows * pairs * PAIR_SCALES];
        for (r, row) in x.chunks_exact(fan_in).enumerate() {
            for (b, block) in row.chunks_exact(BLOCK).enumerate() {
                let scale = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE) / X_MAX;
                let (t, half) = (b / 2, b % 2);
                let pair = &mut values[(r * pairs + t) * PAIR..][..PAIR];
                for (m, &v) in block.iter().enumerate() {
                    let j = half * BLOCK + m; // the input's place in its pair
                    pair[(j % 4) * 16 + j / 4] = quantize(v, scale);
                }
                scales[(r * pairs + t) * PAIR_SCALES + half * 4..][..4].fill(scale);
            }
        }
        let group_sums = x.chunks_exact(group).map(sum).collect();
        Self { values, scales, group_sums, rows, pairs }
    }

    /// Input j of row r, quantized, and its block's scale.
    fn input(&self, r: usize, j: usize) -> (i16, f32) {
        let (t, m) = (r * self.pairs + j / PAIR, j % PAIR);
        (self.values[t * PAIR + (m % 4) * 16 + m / 4], self.scales[t * PAIR_SCALES + (m / BLOCK) * 4])
    }
}

#[inline(always)]
fn quantize(v: f32, scale: f32) -> i16 {
    // |v / scale| <= X_MAX < 2^22 (scale is the block's largest |v| / X_MAX)
    round_ties_even_small(v / scale).clamp(-X_MAX, X_MAX) as i16
}

impl Q4Weights<'_> {
    /// Output o's offsets, one a group.
    #[inline(always)]
    pub(crate) fn offsets_of(&self, o: usize) -> &[f16] {
        let groups = self.fan_in / self.group;
        &self.offsets[o * groups..][..groups]
    }

    /// Output o of a row from its blocks' scaled sums (in block order, already added up) and its
    /// offsets' dot with the row's group sums.
    #[inline(always)]
    pub(crate) fn output(&self, o: usize, blocks_total: f32, offsets_total: f32) -> f32 {
        let total = blocks_total + offsets_total;
        self.bias.map_or(total, |b| total + b[o])
    }
}

/// Columns `outputs` of every row, on the calling thread.
fn run_outputs(x: &QuantizedBlocks, w: &Q4Weights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx2_fma_available() && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2, FMA and F16C; the weights' and x's shapes were checked, the
        // group is a multiple of BLOCK.
        return unsafe { crate::linear_q4_avx2::run_outputs(x, w, outputs, y) };
    }
    plain_outputs(x, w, outputs, y)
}

/// `run_outputs` without AVX2: the same sums, a block at a time.
fn plain_outputs(x: &QuantizedBlocks, w: &Q4Weights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    let (k, groups) = (w.fan_in, w.fan_in / w.group);
    for o in outputs {
        for r in 0..x.rows {
            let mut total = 0.0f32;
            for b in 0..k / BLOCK {
                let mut isum = 0i32;
                for j in b * BLOCK..(b + 1) * BLOCK {
                    let byte = w.packed[(o * k + j) / 2];
                    isum += ((byte >> (4 * (j % 2))) & 0xF) as i32 * x.input(r, j).0 as i32;
                }
                let scale = w.scales[o * groups + b * BLOCK / w.group].to_f32();
                total += (isum as f32 * x.input(r, b * BLOCK).1) * scale;
            }
            let offsets_total =
                crate::vector::dot_f16(w.offsets_of(o), &x.group_sums[r * groups..][..groups]);
            let out = w.output(o, total, offsets_total);
            // SAFETY: this call's range of outputs is its own.
            unsafe { y.set(r * w.fan_out + o, out) };
        }
    }
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
        q as f32 * self.scales[g].to_f32() + self.offsets[g].to_f32()
    }
    #[inline(always)]
    fn finish(&self, o: usize, dot: f32) -> f32 {
        self.bias.map_or(dot, |b| dot + b[o])
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
            _mm256_set1_ps(self.scales[g].to_f32()),
            _mm256_set1_ps(self.offsets[g].to_f32()),
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

    fn halves(n: usize, seed: u32) -> Vec<f16> {
        values(n, seed).into_iter().map(f16::from_f32).collect()
    }

    fn pack(q: &[u8]) -> Vec<u8> {
        q.chunks(2).map(|p| p[0] | (p[1] << 4)).collect()
    }

    /// x as the kernel multiplies it: for groups of a multiple of 32, each block of 32 inputs
    /// quantized to int16 by the rule above and scaled back; smaller groups, x itself.
    fn as_multiplied(x: &[f32], group: usize) -> Vec<f64> {
        if !group.is_multiple_of(BLOCK) {
            return x.iter().map(|&v| v as f64).collect();
        }
        x.chunks(BLOCK)
            .flat_map(|b| {
                let s = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE) / X_MAX;
                b.iter().map(move |&v| quantize(v, s) as f64 * s as f64)
            })
            .collect()
    }

    /// y [rows, n] in float64 from the dequantized weights: `q` the unpacked nibbles, `w` the
    /// layer's scales, offsets, bias and shape (its packed bytes are not read). The offsets meet
    /// x's own sums; the scaled nibbles meet x as the kernel multiplies it.
    fn reference(x: &[f32], q: &[u8], w: &Q4Weights<'_>) -> Vec<f64> {
        let (k, n, group) = (w.fan_in, w.fan_out, w.group);
        let (scales, offsets, bias) = (w.scales, w.offsets, w.bias);
        let (rows, groups) = (x.len() / k, k / group);
        let xm = as_multiplied(x, group);
        let mut y = vec![0.0; rows * n];
        for r in 0..rows {
            for o in 0..n {
                let dot: f64 = (0..k)
                    .map(|j| {
                        let g = o * groups + j / group;
                        xm[r * k + j] * q[o * k + j] as f64 * scales[g].to_f64()
                            + x[r * k + j] as f64 * offsets[g].to_f64()
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
            (6, 128, 3, 32),
            (21, 64, 5, 64),
            (2, 1088, 6, 32), // 34 groups: runs of eight scales, and two after them
            (3, 2560, 5, 128),
        ] {
            let groups = k / group;
            // rows of different magnitudes: each block has a scale of its own
            let x: Vec<f32> =
                values(rows * k, 1).iter().enumerate().map(|(i, v)| v * (1 + i / 40) as f32).collect();
            let (q, b) = (nibbles(n * k, 2), values(n, 3));
            let (scales, offsets) = (halves(n * groups, 4), halves(n * groups, 5));
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

    /// The AVX2 half against the plain loop (its sums in another order: close, not equal), and a
    /// row's bits the same alone as beside other rows, on one thread or several.
    #[test]
    fn the_halves_agree_and_a_row_gets_the_same_bits_alone_beside_other_rows_and_on_several_threads() {
        let (k, n, group) = (256, 1030, 64);
        let (x, q) = (values(7 * k, 6), nibbles(n * k, 7));
        let packed = pack(&q);
        let (scales, offsets) = (halves(n * k / group, 8), halves(n * k / group, 9));
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
        let mut plain = vec![f32::NAN; 7 * n];
        let out = SharedOutputs { ptr: plain.as_mut_ptr(), len: plain.len() };
        plain_outputs(&QuantizedBlocks::of(&x, k, group), &w, 0..n, &out);
        let plain: Vec<f64> = plain.iter().map(|&v| v as f64).collect();
        assert_close(&all, &plain, k);
        assert_close(&all, &reference(&x, &q, &w), k);
    }

    #[test]
    fn extreme_inputs_do_not_saturate_and_a_zero_row_stays_zero() {
        let (k, n, group) = (4096, 8, 32);
        let packed = vec![0xFFu8; n * k / 2]; // every nibble 15
        let (scales, offsets) = (vec![f16::ONE; n * k / group], vec![f16::ZERO; n * k / group]);
        let x: Vec<f32> = (0..2 * k).map(|i| if i < k { -3.0 } else { 0.0 }).collect(); // every product 15 x -32767
        let w = Q4Weights {
            packed: &packed,
            scales: &scales,
            offsets: &offsets,
            group,
            bias: None,
            fan_in: k,
            fan_out: n,
        };
        let mut y = vec![f32::NAN; 2 * n];
        linear_q4(&x, &w, &mut y).unwrap();
        assert!(y[..n].iter().all(|&v| v == -3.0 * 15.0 * k as f32), "{:?}", &y[..n]);
        assert!(y[n..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn bad_shapes_and_groups_are_errors_naming_the_argument() {
        let (packed, s) = (vec![0u8; 3 * 32], vec![f16::ONE; 6]);
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
        let short = linear_q4(&[0.0; 63], &ok, &mut [0.0; 3]).unwrap_err().to_string();
        assert!(short.starts_with("x:"), "{short}");
    }
}
