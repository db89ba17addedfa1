//! `linear_kquant` for a GGUF file's Q4_0 and Q4_1 rows in place (32 weights a block: Q4_0 18
//! bytes, d as f16 and qs[16]; Q4_1 20 bytes, d and m as f16 and qs[16]; weight j in qs[j]'s low
//! nibble, j + 16 in its high one): a file served as it is mapped, with no repacking at load.
//!
//! x is quantized as `linear_q4` quantizes it (int16 a block of 32 inputs, scale max(max |x|,
//! f32::MIN_POSITIVE) / 32767, x / scale rounded half to even) and stored a pair of blocks at a
//! time in the order the vector half widens a pair's nibbles (`PairedRows`).
//! - Q4_0: weight = (q - 8) * d; a block's products (q - 8) * xq sum exactly in i32 (|.| <= 32 *
//!   8 * 32767 < 2^24), times d and the x scale.
//! - Q4_1: weight = q * d + m; the products q * xq likewise (<= 32 * 15 * 32767 < 2^24), times d
//!   and the x scale, plus m times the f32 sum of the block's inputs, summed apart and added at
//!   the end.
//!
//! int16 activations, not llama.cpp's int8 ones (its q8_0 / q8_1 for these types): on int8
//! SmolLM2-135M-Instruct's top-1 agreement with transformers on its Q4_1 file fell from 0.985 to
//! 0.943 (a block's step is then 1/254 of its largest input, at int16 1/65534).
//!
//! Every output is summed in one fixed order (its pairs of blocks in turn, lane by lane, then the
//! lanes' order, then the minimums' term likewise) whatever the rows beside it, the tile it falls
//! in or the thread: a row gets the same bits alone or in a batch.

use std::ops::Range;

use crate::gguf_blocks::{f16_at, BlockKind};
use crate::linear::{for_output_ranges, SharedOutputs, CHUNK_ROWS};
use crate::linear_kquant::KQuantWeights;
use crate::parallel::ForkJoin;
use crate::vector::{round_ties_even_small, sum};

/// Weights (and inputs) of a block.
pub(crate) const BLOCK: usize = 32;
/// Inputs of a pair of blocks: what one step of the vector half multiplies.
pub(crate) const PAIR: usize = 2 * BLOCK;
/// Per-lane values stored a pair: each block's, once for each of the four i32 lanes its sums land in.
pub(crate) const PAIR_LANES: usize = 8;
/// The largest quantized activation.
const X_MAX: f32 = 32767.0;

/// Where a block's nibbles start (after d, and m for Q4_1), and whether it has a minimum.
#[inline(always)]
pub(crate) fn layout(kind: BlockKind) -> (usize, bool) {
    if kind == BlockKind::Q4_1 {
        (4, true)
    } else {
        (2, false)
    }
}

/// Rows of x as the vector half multiplies them. A row is stored in pairs of blocks (the last
/// padded with zeros); a pair's 64 int16 values are four runs of sixteen, run c lane l holding
/// the input of block l / 8 at place `NIBBLE_PLACE[c] + 2 * (l % 8)`: the weight the nibble c of
/// the block's bytes 2i, 2i + 1 (read as one u16 lane, i = l % 8) holds. `scales`: a pair's eight
/// lanes, block 2t's x scale four times then block 2t + 1's (zero past the row's end); `sums`
/// likewise each block's f32 input sum (Q4_1's minimums' term; empty for Q4_0).
pub(crate) struct PairedRows {
    pub values: Vec<i16>,
    pub scales: Vec<f32>,
    pub sums: Vec<f32>,
    pub rows: usize,
    pub pairs: usize,
}

/// The weight of a block (0..32) each of a u16 lane's four nibbles holds, less 2 * (lane % 8):
/// byte 2i's low and high nibbles (weights 2i, 2i + 16), byte 2i + 1's (2i + 1, 2i + 17).
const NIBBLE_PLACE: [usize; 4] = [0, 16, 1, 17];

impl PairedRows {
    pub(crate) fn of(x: &[f32], fan_in: usize, with_sums: bool) -> Self {
        let rows = x.len() / fan_in;
        let pairs = fan_in.div_ceil(PAIR);
        let mut values = vec![0i16; rows * pairs * PAIR];
        let mut scales = vec![0.0f32; rows * pairs * PAIR_LANES];
        let mut sums = vec![0.0f32; if with_sums { rows * pairs * PAIR_LANES } else { 0 }];
        for (r, row) in x.chunks_exact(fan_in).enumerate() {
            for (b, block) in row.chunks_exact(BLOCK).enumerate() {
                let scale = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE) / X_MAX;
                let (t, half) = (r * pairs + b / 2, b % 2);
                let pair = &mut values[t * PAIR..][..PAIR];
                for (c, place) in NIBBLE_PLACE.iter().enumerate() {
                    for i in 0..8 {
                        // |v / scale| <= X_MAX < 2^22
                        let v = round_ties_even_small(block[place + 2 * i] / scale).clamp(-X_MAX, X_MAX);
                        pair[c * 16 + half * 8 + i] = v as i16;
                    }
                }
                scales[t * PAIR_LANES + half * 4..][..4].fill(scale);
                if with_sums {
                    sums[t * PAIR_LANES + half * 4..][..4].fill(sum(block));
                }
            }
        }
        Self { values, scales, sums, rows, pairs }
    }

    /// Input j of row r, quantized, its block's scale and, where kept, its block's sum.
    fn input(&self, r: usize, j: usize) -> (i16, f32, f32) {
        let (t, half, w) = (r * self.pairs + j / PAIR, (j % PAIR) / BLOCK, j % BLOCK);
        let (c, i) =
            (NIBBLE_PLACE.iter().position(|&p| p == w % 2 + 16 * (w / 16 % 2)).unwrap(), (w % 16) / 2);
        let lane = t * PAIR_LANES + half * 4;
        (
            self.values[t * PAIR + c * 16 + half * 8 + i],
            self.scales[lane],
            self.sums.get(lane).copied().unwrap_or(0.0),
        )
    }
}

/// `y = x W^T + bias` for Q4_0 / Q4_1 weights whose shapes `linear_kquant` checked, outputs
/// spread over `pool`.
pub(crate) fn linear_q4_blocks_on(pool: &dyn ForkJoin, x: &[f32], w: &KQuantWeights<'_>, y: &mut [f32]) {
    let (k, n) = (w.fan_in, w.fan_out);
    let with_sums = layout(w.kind).1;
    for (xs, ys) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
        let paired = PairedRows::of(xs, k, with_sums);
        let out = SharedOutputs { ptr: ys.as_mut_ptr(), len: ys.len() };
        for_output_ranges(pool, n, paired.rows * k * n, &|outputs| run_outputs(&paired, w, outputs, &out));
    }
}

/// Columns `outputs` of every row, on the calling thread.
fn run_outputs(x: &PairedRows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx2_fma_available() && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2, FMA and F16C; the shapes and the kind were checked.
        return unsafe { crate::linear_q4_blocks_avx2::run_outputs(x, w, outputs, y) };
    }
    plain_outputs(x, w, outputs, y)
}

/// `run_outputs` without AVX2: the same integer sums, a block at a time.
fn plain_outputs(x: &PairedRows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    let bytes = w.kind.weights_and_bytes().1;
    let (qs_at, has_min) = layout(w.kind);
    let zero = if has_min { 0 } else { 8 };
    for o in outputs {
        for r in 0..x.rows {
            let (mut total, mut mins) = (0.0f32, 0.0f32);
            for (b, block) in w.row(o).chunks_exact(bytes).enumerate() {
                let qs = &block[qs_at..][..16];
                let q = |j: usize| (if j < 16 { qs[j] & 0x0F } else { qs[j - 16] >> 4 }) as i32 - zero;
                let dot: i32 = (0..BLOCK).map(|j| q(j) * x.input(r, b * BLOCK + j).0 as i32).sum();
                let (_, scale, block_sum) = x.input(r, b * BLOCK);
                total += dot as f32 * (f16_at(block, 0).to_f32() * scale);
                if has_min {
                    mins = f16_at(block, 2).to_f32().mul_add(block_sum, mins);
                }
            }
            // SAFETY: this call's range of outputs is its own.
            unsafe { y.set(r * w.fan_out + o, w.output(o, total + mins)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use crate::linear::tests::values;
    use crate::linear_kquant::linear_kquant;
    use crate::linear_kquant::tests::{
        assert_matches_reference, assert_near, blocks, rows_alone_as_in_a_batch, widened_reference,
    };

    const KINDS: [BlockKind; 2] = [BlockKind::Q4_0, BlockKind::Q4_1];

    /// `linear_kquant`'s float64 reference with x as this kernel multiplies it: int16 per block,
    /// scaled back, except in Q4_1's minimums' term, which takes the inputs as they are.
    fn reference(x: &[f32], w: &KQuantWeights<'_>) -> (Vec<f64>, Vec<f64>) {
        let (k, n, bytes) = (w.fan_in, w.fan_out, w.kind.weights_and_bytes().1);
        let q = PairedRows::of(x, k, false);
        let rows = x.len() / k;
        let xm: Vec<f64> = (0..rows * k)
            .map(|i| {
                let (v, scale, _) = q.input(i / k, i % k);
                v as f64 * scale as f64
            })
            .collect();
        let (mut y, magnitude) = widened_reference(&xm, w);
        if w.kind == BlockKind::Q4_1 {
            // the minimums' term of the quantized inputs, replaced by that of the inputs
            for (r, row) in x.chunks_exact(k).enumerate() {
                for o in 0..n {
                    for b in 0..k / BLOCK {
                        let m = f16_at(&w.row(o)[b * bytes..], 2).to_f32() as f64;
                        let exact: f64 = row[b * BLOCK..][..BLOCK].iter().map(|&v| v as f64).sum();
                        let quantized: f64 = xm[r * k + b * BLOCK..][..BLOCK].iter().sum();
                        y[r * n + o] += m * (exact - quantized);
                    }
                }
            }
        }
        (y, magnitude)
    }

    #[test]
    fn inputs_are_stored_where_the_nibbles_holding_their_weights_land() {
        // block 0's nibble c of u16 lane i holds weight NIBBLE_PLACE[c] + 2i; block 1's likewise
        let x: Vec<f32> = (0..96).map(|j| j as f32 - 48.0).collect();
        let q = PairedRows::of(&x, 96, true);
        assert_eq!(q.pairs, 2);
        for (j, &want) in x.iter().enumerate() {
            let (v, scale, _) = q.input(0, j);
            assert!((v as f32 * scale - want).abs() <= 0.5001 * scale, "input {j}");
        }
        assert_eq!(q.values[16], q.input(0, 16).0); // run 1, lane 0: block 0's weight 16
        assert_eq!(q.values[2 * 16 + 8 + 3], q.input(0, 32 + 7).0); // run 2, lane 11: block 1's 2 * 3 + 1
        for run in 0..4 {
            assert_eq!(q.values[PAIR + run * 16 + 8..][..8], [0; 8]); // the padding block after block 2
        }
        assert_eq!(q.sums[..8], [-1040.0, -1040.0, -1040.0, -1040.0, -16.0, -16.0, -16.0, -16.0]);
        assert_eq!(q.scales[PAIR_LANES + 4..][..4], [0.0; 4]);
    }

    #[test]
    fn matches_a_float64_reference_of_the_widened_weights_and_int16_inputs() {
        let shapes = [(1, 32, 5), (1, 576, 7), (3, 96, 9), (5, 576, 6), (9, 64, 3), (17, 32, 4)];
        for kind in KINDS {
            assert_matches_reference(kind, &shapes, reference);
        }
    }

    /// The vector half against the plain loop, and a row's bits the same alone as beside other
    /// rows (tiles of up to eight and their remainders), on one thread or several.
    #[test]
    fn the_halves_agree_and_a_row_gets_the_same_bits_alone_beside_other_rows_and_on_several_threads() {
        for kind in KINDS {
            for k in [576, 608] {
                let (n, rows) = (1030, 11);
                let (x, b) = (values(rows * k, 6), blocks(kind, n, k, 7));
                let w = KQuantWeights { kind, blocks: vec![&b], bias: None, fan_in: k, fan_out: n };
                let all = rows_alone_as_in_a_batch(&x, &w);
                let mut plain = vec![f32::NAN; rows * n];
                let out = SharedOutputs { ptr: plain.as_mut_ptr(), len: plain.len() };
                plain_outputs(&PairedRows::of(&x, k, kind == BlockKind::Q4_1), &w, 0..n, &out);
                let want = reference(&x, &w);
                assert_near(&all, &want);
                assert_near(&plain, &want);
            }
        }
    }

    #[test]
    fn extreme_inputs_do_not_overflow() {
        // every nibble 15 (Q4_1: q = 15; Q4_0: q - 8 = 7) against every xq 32767 (x all 3)
        let k = 1024;
        for (kind, q) in [(BlockKind::Q4_0, 7.0), (BlockKind::Q4_1, 15.0)] {
            let (qs_at, _) = layout(kind);
            let bytes = kind.weights_and_bytes().1;
            let mut b = vec![0xFFu8; k / BLOCK * bytes];
            for block in b.chunks_exact_mut(bytes) {
                block[..2].copy_from_slice(&f16::ONE.to_le_bytes());
                block[2..qs_at].fill(0); // Q4_1's m: 0
            }
            let w = KQuantWeights { kind, blocks: vec![&b], bias: None, fan_in: k, fan_out: 1 };
            let mut y = [f32::NAN];
            linear_kquant(&vec![3.0f32; k], &w, &mut y).unwrap();
            let want = 3.0 * q * k as f32;
            assert!((y[0] - want).abs() <= want * 1e-6, "{kind:?}: {} against {want}", y[0]);
        }
    }
}
