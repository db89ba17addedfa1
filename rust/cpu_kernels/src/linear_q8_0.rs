//! `linear_kquant` for a GGUF file's Q8_0 rows in place (34 bytes a block of 32 weights: d as
//! f16, q[32] i8; weight = q * d), on int16 activations: each row of x is quantized once a call
//! per block of 32 inputs (scale max(max |x|, f32::MIN_POSITIVE) / 32767, x / scale rounded half
//! to even), a block's products q * xq are summed exactly in i32 (|.| <= 32 * 128 * 32767 < 2^27;
//! the vector half's lanes hold four products each, < 2^24, exact in f32) and added in f32 times
//! d and the x scale.
//!
//! int8 activations (llama.cpp's q8_0 . q8_0, as Q5_0 and the K-quants take them here) multiply
//! faster, but a Q8_0 tensor is most often a file's head, where they cost a small model its
//! answers: SmolLM2-135M-Instruct's Q8_0 head on them answered "What is the capital of France?"
//! with another first token than the widened file. Top-1 agreement with the widened file along
//! 1,024 reference tokens (its Q4_1 layers on `linear_q4`): 0.984 with the head on int8
//! activations, 1.000 on int16 ones; 0.985 before, the head re-rounded to int8 rows at load.
//!
//! Every output is summed in one fixed order (its blocks in turn, lane by lane, then the lanes'
//! order) whatever the rows beside it, the tile it falls in or the thread: a row gets the same
//! bits alone or in a batch.

use std::ops::Range;

use crate::gguf_blocks::f16_at;
use crate::linear::{for_output_ranges, SharedOutputs, CHUNK_ROWS};
use crate::linear_kquant::KQuantWeights;
use crate::parallel::ForkJoin;
use crate::vector::round_ties_even_small;

/// Weights (and inputs) of a block, and a block's bytes.
pub(crate) const BLOCK: usize = 32;
pub(crate) const BYTES: usize = 34;
/// The largest quantized activation.
const X_MAX: f32 = 32767.0;

/// Rows of x quantized to int16 in input order (`values` [rows, fan_in]), a scale a block of 32
/// (`scales` [rows, fan_in / 32]).
pub(crate) struct Int16Rows {
    pub values: Vec<i16>,
    pub scales: Vec<f32>,
    pub rows: usize,
}

impl Int16Rows {
    pub(crate) fn of(x: &[f32], fan_in: usize) -> Self {
        let mut values = vec![0i16; x.len()];
        let mut scales = Vec::with_capacity(x.len() / BLOCK);
        for (block, out) in x.chunks_exact(BLOCK).zip(values.chunks_exact_mut(BLOCK)) {
            let scale = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE) / X_MAX;
            for (q, &v) in out.iter_mut().zip(block) {
                // |v / scale| <= X_MAX < 2^22
                *q = round_ties_even_small(v / scale).clamp(-X_MAX, X_MAX) as i16;
            }
            scales.push(scale);
        }
        Self { values, scales, rows: x.len() / fan_in }
    }
}

/// `y = x W^T + bias` for Q8_0 weights whose shapes `linear_kquant` checked, outputs spread over
/// `pool`.
pub(crate) fn linear_q8_0_on(pool: &dyn ForkJoin, x: &[f32], w: &KQuantWeights<'_>, y: &mut [f32]) {
    let (k, n) = (w.fan_in, w.fan_out);
    for (xs, ys) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
        let quantized = Int16Rows::of(xs, k);
        let out = SharedOutputs { ptr: ys.as_mut_ptr(), len: ys.len() };
        for_output_ranges(pool, n, quantized.rows * k * n, &|outputs| {
            run_outputs(&quantized, w, outputs, &out)
        });
    }
}

/// Columns `outputs` of every row, on the calling thread.
fn run_outputs(x: &Int16Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx2_fma_available() && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2, FMA and F16C; the shapes were checked.
        return unsafe { crate::linear_q8_0_avx2::run_outputs(x, w, outputs, y) };
    }
    plain_outputs(x, w, outputs, y)
}

/// `run_outputs` without AVX2: the same integer sums.
fn plain_outputs(x: &Int16Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    let k = w.fan_in;
    for o in outputs {
        for r in 0..x.rows {
            let mut total = 0.0f32;
            for (b, block) in w.row(o).chunks_exact(BYTES).enumerate() {
                let xs = &x.values[r * k + b * BLOCK..][..BLOCK];
                let dot: i32 = block[2..].iter().zip(xs).map(|(&q, &v)| q as i8 as i32 * v as i32).sum();
                total += dot as f32 * (f16_at(block, 0).to_f32() * x.scales[r * k / BLOCK + b]);
            }
            // SAFETY: this call's range of outputs is its own.
            unsafe { y.set(r * w.fan_out + o, w.output(o, total)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use crate::gguf_blocks::BlockKind;
    use crate::linear::tests::values;
    use crate::linear_kquant::linear_kquant;
    use crate::linear_kquant::tests::{
        assert_matches_reference, assert_near, blocks, rows_alone_as_in_a_batch, widened_reference,
    };

    /// `linear_kquant`'s float64 reference with x as this kernel multiplies it (int16 per block,
    /// scaled back).
    fn reference(x: &[f32], w: &KQuantWeights<'_>) -> (Vec<f64>, Vec<f64>) {
        let q = Int16Rows::of(x, w.fan_in);
        let xm: Vec<f64> =
            q.values.iter().enumerate().map(|(i, &v)| v as f64 * q.scales[i / BLOCK] as f64).collect();
        widened_reference(&xm, w)
    }

    #[test]
    fn matches_a_float64_reference_of_the_widened_weights_and_int16_inputs() {
        let shapes = [(1, 32, 5), (1, 576, 7), (3, 96, 9), (5, 576, 6), (9, 64, 3), (17, 32, 4)];
        assert_matches_reference(BlockKind::Q8_0, &shapes, reference);
    }

    /// The vector half against the plain loop, and a row's bits the same alone as beside other
    /// rows, on one thread or several.
    #[test]
    fn the_halves_agree_and_a_row_gets_the_same_bits_alone_beside_other_rows_and_on_several_threads() {
        let (k, n) = (576, 1030);
        let (x, b) = (values(7 * k, 6), blocks(BlockKind::Q8_0, n, k, 7));
        let w = KQuantWeights { kind: BlockKind::Q8_0, blocks: vec![&b], bias: None, fan_in: k, fan_out: n };
        let all = rows_alone_as_in_a_batch(&x, &w);
        let mut plain = vec![f32::NAN; 7 * n];
        let out = SharedOutputs { ptr: plain.as_mut_ptr(), len: plain.len() };
        plain_outputs(&Int16Rows::of(&x, k), &w, 0..n, &out);
        let want = reference(&x, &w);
        assert_near(&all, &want);
        assert_near(&plain, &want);
    }

    #[test]
    fn extreme_inputs_do_not_overflow() {
        // every q -128 against every xq -32767 (x all -3): the largest block sum
        let k = 1024;
        let mut b = vec![0x80u8; k / BLOCK * BYTES];
        for block in b.chunks_exact_mut(BYTES) {
            block[..2].copy_from_slice(&f16::ONE.to_le_bytes());
        }
        let w = KQuantWeights { kind: BlockKind::Q8_0, blocks: vec![&b], bias: None, fan_in: k, fan_out: 1 };
        let mut y = [f32::NAN];
        linear_kquant(&vec![-3.0f32; k], &w, &mut y).unwrap();
        let want = 3.0 * 128.0 * k as f32;
        assert!((y[0] - want).abs() <= want * 1e-6, "{} against {want}", y[0]);
    }
}
