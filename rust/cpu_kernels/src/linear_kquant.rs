//! Linear layers over a GGUF file's K-quant, Q5_0, Q8_0, Q4_0 and Q4_1 rows as the file holds them:
//! Q4_K (4.5 bits a weight), Q6_K (6.5625), Q5_0 (5.5), Q8_0 (8.5), Q4_0 (4.5) and Q4_1 (5), read
//! in place, where converting them to `linear_q4`'s groups of 32 (5 bits) or `linear_q8`'s rows
//! (8 bits, and the weights re-rounded) would make every step read more bytes, or the load
//! convert every row. Layouts are `gguf_blocks`' (llama.cpp's ggml-common.h): a row of `fan_in`
//! weights is fan_in / 256 super-blocks of 144 (Q4_K) or 210 (Q6_K) bytes, or fan_in / 32 blocks
//! of 22 (Q5_0), 34 (Q8_0), 18 (Q4_0) or 20 (Q4_1).
//!
//! Activations are quantized as llama.cpp quantizes them for these types (its Q8_K, and Q8_0 for
//! Q5_0): int8 with one scale per block of 256 inputs (32 for Q5_0; max |x| / 127, x / scale
//! rounded half to even), so that `vpmaddubsw` multiplies 32 weights a step and each block sums
//! exactly in i32:
//! - Q4_K: sum_j d * sc[j] * (q . xq)_j - dmin * m[j] * sum(xq)_j over its 8 sub-blocks of 32
//!   (q in 0..16; sc, m six bits), times the x scale (`linear_q4k_vnni` with AVX-512 VNNI,
//!   else `linear_kquant_avx2`);
//! - Q6_K: sum_g d * sc[g] * ((q . xq)_g - 32 * sum(xq)_g) over its 16 groups of 16 (q in 0..64,
//!   sc an int8), times the x scale;
//! - Q5_0: d * ((q - 16) . xq) (q in 0..32), times the x scale (`linear_q5_avx2`);
//! - Q8_0, Q4_0 and Q4_1 take int16 activations instead (`linear_q8_0`, `linear_q4_blocks` say why).
//!
//! A layer's rows may lie in several slices (`KQuantWeights::blocks`: projections over the same
//! inputs that the file holds apart), read in turn as one layer's: one quantization of x and one
//! fork over their outputs where side by side they would take one each.
//!
//! The same arithmetic as llama.cpp's on the same file, and the same bytes a step; the int16
//! activations of `linear_q4` would cost these layers twice the multiplies (measured: the int16
//! form of this kernel ran at ~15 GB/s, compute-bound on two AVX2 cores, against ~28 for the 4-bit
//! layout's).
//!
//! Every output is summed in one fixed order whatever the rows beside it, the tile it falls in
//! or the thread: a row gets the same bits alone or in a batch.

use std::ops::Range;

use crate::gguf_blocks::{f16_at, q4_k_nibbles, q4_k_scale_min, q6_k_run, BlockKind};
use crate::linear::{check_rows, for_output_ranges, LinearError, SharedOutputs, CHUNK_ROWS};
use crate::parallel::{ForkJoin, OnCallingThread};
use crate::vector::round_ties_even_small;

/// Weights of a K-quant super-block, and inputs sharing an activation scale.
pub(crate) const SUPER: usize = 256;
/// The largest quantized activation.
const X_MAX: f32 = 127.0;

/// One K-quant linear layer: `blocks`, the rows of each slice in turn [fan_out, fan_in / 256 *
/// bytes a super-block]: one slice, or projections over the same inputs that the file holds
/// apart (a layer's q, k and v; its gate and up) run as one.
pub struct KQuantWeights<'a> {
    pub kind: BlockKind,
    pub blocks: Vec<&'a [u8]>,
    pub bias: Option<&'a [f32]>,
    pub fan_in: usize,
    pub fan_out: usize,
}

impl KQuantWeights<'_> {
    /// Bytes of a row (0 where fan_in is not a whole number of blocks: `check` refuses it).
    pub(crate) fn row_bytes(&self) -> usize {
        self.kind.row_bytes(self.fan_in).unwrap_or(0)
    }

    fn check(&self) -> Result<(), LinearError> {
        let (k, n) = (self.fan_in, self.fan_out);
        if self.kind.row_bytes(k).is_none() {
            return Err(LinearError::new(format!(
                "fan_in: {k} is not a whole number of {:?}'s {}-weight blocks",
                self.kind,
                self.kind.weights_and_bytes().0
            )));
        }
        let row_bytes = self.row_bytes();
        let total: usize = self.blocks.iter().map(|b| b.len()).sum();
        if total != n * row_bytes || self.blocks.iter().any(|b| !b.len().is_multiple_of(row_bytes)) {
            let bytes: Vec<usize> = self.blocks.iter().map(|b| b.len()).collect();
            return Err(LinearError::new(format!(
                "blocks: {bytes:?} bytes for [fan_out {n}, fan_in {k}] of {:?} ({row_bytes} bytes a row)",
                self.kind,
            )));
        }
        Ok(())
    }

    /// Row o's bytes (o < fan_out, the shapes checked).
    #[inline(always)]
    pub(crate) fn row(&self, o: usize) -> &[u8] {
        let row_bytes = self.row_bytes();
        let mut rest = o;
        for part in &self.blocks {
            let rows = part.len() / row_bytes;
            if rest < rows {
                return &part[rest * row_bytes..][..row_bytes];
            }
            rest -= rows;
        }
        panic!("row {o} of a layer of {} rows", self.fan_out)
    }

    #[inline(always)]
    pub(crate) fn output(&self, o: usize, total: f32) -> f32 {
        self.bias.map_or(total, |b| total + b[o])
    }

    /// Inputs sharing an activation scale: a K-quant super-block, or a Q5_0 block.
    fn activation_block(&self) -> usize {
        self.kind.weights_and_bytes().0
    }
}

/// `y = x W^T + bias` on the calling thread.
pub fn linear_kquant(x: &[f32], weights: &KQuantWeights<'_>, y: &mut [f32]) -> Result<(), LinearError> {
    linear_kquant_on(&OnCallingThread, x, weights, y)
}

/// `linear_kquant` with the outputs spread over the threads of `pool`; the same bits as on one thread.
pub fn linear_kquant_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    weights: &KQuantWeights<'_>,
    y: &mut [f32],
) -> Result<(), LinearError> {
    weights.check()?;
    let (k, n) = (weights.fan_in, weights.fan_out);
    check_rows(x, k, n, weights.bias, y)?;
    match weights.kind {
        BlockKind::Q8_0 => {
            crate::linear_q8_0::linear_q8_0_on(pool, x, weights, y);
            return Ok(());
        }
        BlockKind::Q4_0 | BlockKind::Q4_1 => {
            crate::linear_q4_blocks::linear_q4_blocks_on(pool, x, weights, y);
            return Ok(());
        }
        _ => {}
    }
    for (xs, ys) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
        let mut quantized = Int8Rows::of(xs, k, weights.activation_block());
        if uses_q4k_lanes(weights.kind) {
            quantized.lanes = quantized.q4k_lanes();
        }
        let out = SharedOutputs { ptr: ys.as_mut_ptr(), len: ys.len() };
        for_output_ranges(pool, n, quantized.rows * k * n, &|outputs| {
            run_outputs(&quantized, weights, outputs, &out)
        });
    }
    Ok(())
}

/// Rows of x as the integer products take them, in input order: `values` [rows, fan_in] int8,
/// each block of `block` inputs (256, or 32 for Q5_0) with its scale in `scales` [rows, fan_in /
/// block], and the sums of its quantized values per 16 inputs (`sums16` [rows, fan_in / 16],
/// Q6_K's groups) and per 32 (`sums32` [rows, fan_in / 32], Q4_K's sub-blocks); `lanes`: the
/// values in `q4k_lanes`' order where the VNNI half reads them, else empty.
pub(crate) struct Int8Rows {
    pub values: Vec<i8>,
    pub lanes: Lines,
    pub scales: Vec<f32>,
    pub sums16: Vec<i16>,
    pub sums32: Vec<i16>,
    pub rows: usize,
}

impl Int8Rows {
    pub(crate) fn of(x: &[f32], fan_in: usize, block: usize) -> Self {
        let rows = x.len() / fan_in;
        let mut values = vec![0i8; x.len()];
        let mut scales = Vec::with_capacity(x.len() / block);
        let mut sums16 = vec![0i16; x.len() / 16];
        let runs = x
            .chunks_exact(block)
            .zip(values.chunks_exact_mut(block))
            .zip(sums16.chunks_exact_mut(block / 16));
        for ((block, out), sums) in runs {
            #[cfg(target_arch = "x86_64")]
            if crate::vector::avx2_fma_available() {
                // SAFETY: the CPU has AVX2; a block is a whole number of 32 inputs.
                scales.push(unsafe { crate::linear_kquant_avx2::quantize(block, out, sums) });
                continue;
            }
            scales.push(quantize(block, out, sums));
        }
        let sums32 = sums16.chunks_exact(2).map(|c| c[0] + c[1]).collect(); // |.| <= 4064
        Self { values, lanes: Lines::default(), scales, sums16, sums32, rows }
    }

    /// `values` with each super-block's runs of 16 reordered as `linear_q4k_vnni` pairs them with
    /// its nibbles: for chunks c = 0..4 the inputs 64c..64c + 16, then for each c 64c + 16..64c +
    /// 32, then 64c + 32..64c + 48, then 64c + 48..64c + 64.
    pub(crate) fn q4k_lanes(&self) -> Lines {
        let mut lanes = Lines(vec![Line([0; 64]); self.values.len() / 64]);
        for (from, to) in self.values.chunks_exact(SUPER).zip(lanes.0.chunks_exact_mut(SUPER / 64)) {
            for (run, out) in to.iter_mut().flat_map(|line| line.0.chunks_exact_mut(16)).enumerate() {
                let (quarter, c) = (run / 4, run % 4);
                out.copy_from_slice(&from[64 * c + 16 * quarter..][..16]);
            }
        }
        lanes
    }
}

/// Int8 values in cache lines (64-byte aligned), so that a 64-byte load never spans two.
#[derive(Default)]
pub(crate) struct Lines(Vec<Line>);

#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line([i8; 64]);

impl Lines {
    pub(crate) fn as_ptr(&self) -> *const i8 {
        self.0.as_ptr() as *const i8
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A block's int8 values (written to `out`, their sums per 16 to `sums16`) and its scale: max |x|
/// / 127, x / scale rounded half to even.
fn quantize(block: &[f32], out: &mut [i8], sums16: &mut [i16]) -> f32 {
    let scale = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE) / X_MAX;
    for (q, &v) in out.iter_mut().zip(block) {
        // |v / scale| <= 127 < 2^22
        *q = round_ties_even_small(v / scale).clamp(-X_MAX, X_MAX) as i8;
    }
    for (sum, run) in sums16.iter_mut().zip(out.chunks_exact(16)) {
        *sum = run.iter().map(|&v| v as i16).sum();
    }
    scale
}

/// Whether `run_outputs` takes this kind's rows to `linear_q4k_vnni`.
fn uses_q4k_lanes(kind: BlockKind) -> bool {
    #[cfg(target_arch = "x86_64")]
    if kind == BlockKind::Q4K && crate::linear_q4k_vnni::available() {
        return true;
    }
    false
}

/// Columns `outputs` of every row, on the calling thread.
fn run_outputs(x: &Int8Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx2_fma_available() && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2, FMA and F16C; the shapes and the kind were checked.
        return unsafe {
            match w.kind {
                BlockKind::Q5_0 => crate::linear_q5_avx2::run_outputs(x, w, outputs, y),
                // SAFETY: x.lanes is filled only where `uses_q4k_lanes` found AVX-512 F, BW, VL
                // and VNNI: the decision made once a call, followed here
                BlockKind::Q4K if !x.lanes.is_empty() => {
                    crate::linear_q4k_vnni::run_outputs(x, w, outputs, y)
                }
                _ => crate::linear_kquant_avx2::run_outputs(x, w, outputs, y),
            }
        };
    }
    plain_outputs(x, w, outputs, y)
}

/// `run_outputs` without AVX2: the same integer sums.
fn plain_outputs(x: &Int8Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    let k = w.fan_in;
    let (weights, bytes) = w.kind.weights_and_bytes();
    for o in outputs {
        for r in 0..x.rows {
            let mut total = 0.0f32;
            for (s, block) in w.row(o).chunks_exact(bytes).enumerate() {
                let at = r * k + s * weights; // the block's first input
                let xs = &x.values[at..][..weights];
                let sum = match w.kind {
                    BlockKind::Q4K => q4_k_plain(block, xs, &x.sums32[at / 32..][..8]),
                    BlockKind::Q5_0 => q5_0_plain(block, xs),
                    _ => q6_k_plain(block, xs, &x.sums16[at / 16..][..16]),
                };
                total += sum * x.scales[at / weights];
            }
            // SAFETY: this call's range of outputs is its own.
            unsafe { y.set(r * w.fan_out + o, w.output(o, total)) };
        }
    }
}

/// A Q4_K super-block's sum against xq, before the x scale.
fn q4_k_plain(block: &[u8], xs: &[i8], sums32: &[i16]) -> f32 {
    let (mut scaled, mut mins) = (0i32, 0i32);
    for j in 0..8 {
        let (sc, m) = q4_k_scale_min(&block[4..16], j);
        let dot: i32 =
            q4_k_nibbles(block, j).iter().zip(&xs[32 * j..][..32]).map(|(&q, &v)| q as i32 * v as i32).sum();
        scaled += sc as i32 * dot;
        mins += m as i32 * sums32[j] as i32;
    }
    f16_at(block, 0).to_f32() * scaled as f32 - f16_at(block, 2).to_f32() * mins as f32
}

/// A Q5_0 block's sum against xq, before the x scale.
fn q5_0_plain(block: &[u8], xs: &[i8]) -> f32 {
    let qh = u32::from_le_bytes(block[2..6].try_into().unwrap());
    let dot: i32 = (0..32)
        .map(|j| {
            let low = if j < 16 { block[6 + j] & 0x0F } else { block[6 + j - 16] >> 4 };
            let q = (low | (((qh >> j) & 1) as u8) << 4) as i32 - 16;
            q * xs[j] as i32
        })
        .sum();
    f16_at(block, 0).to_f32() * dot as f32
}

/// A Q6_K super-block's sum against xq, before the x scale.
fn q6_k_plain(block: &[u8], xs: &[i8], sums16: &[i16]) -> f32 {
    let sc = &block[192..208];
    let mut scaled = 0i32;
    for run in 0..8 {
        let q = q6_k_run(block, run);
        for g in 0..2 {
            let dot: i32 = (16 * g..16 * g + 16).map(|b| q[b] as i32 * xs[32 * run + b] as i32).sum();
            let group = 2 * run + g;
            scaled += sc[group] as i8 as i32 * (dot - 32 * sums16[group] as i32);
        }
    }
    f16_at(block, 208).to_f32() * scaled as f32
}

#[cfg(test)]
pub(crate) mod tests {
    use half::f16;

    use super::*;
    use crate::gguf_blocks::widen;
    use crate::linear::tests::{values, TwoParts};

    /// Random but well-formed rows: f16 scales of sensible size, any other byte.
    pub(crate) fn blocks(kind: BlockKind, rows: usize, k: usize, seed: u32) -> Vec<u8> {
        let (weights, bytes) = kind.weights_and_bytes();
        let raw: Vec<u8> =
            values(rows * k / weights * bytes, seed).iter().map(|v| ((v + 1.0) * 127.5) as u8).collect();
        let mut out = raw.clone();
        for block in out.chunks_exact_mut(bytes) {
            let halves: &[usize] = match kind {
                BlockKind::Q4K | BlockKind::Q4_1 => &[0, 2],
                BlockKind::Q5_0 | BlockKind::Q8_0 | BlockKind::Q4_0 => &[0],
                _ => &[208],
            };
            for (i, &at) in halves.iter().enumerate() {
                let v = f16::from_f32(0.001 + 0.01 * (block[bytes - 5 + i] as f32 / 255.0));
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// (y, the sum of its terms' magnitudes) in float64 from the widened weights (gguf's
    /// arithmetic, `widen`) and x as the kernel multiplies it (int8 per block, scaled back).
    fn reference(x: &[f32], w: &KQuantWeights<'_>) -> (Vec<f64>, Vec<f64>) {
        let block = w.activation_block();
        let q = Int8Rows::of(x, w.fan_in, block);
        let xm: Vec<f64> =
            q.values.iter().enumerate().map(|(i, &v)| v as f64 * q.scales[i / block] as f64).collect();
        widened_reference(&xm, w)
    }

    /// `reference` for x as multiplied (`xm`, each value its quantized one times its scale).
    pub(crate) fn widened_reference(xm: &[f64], w: &KQuantWeights<'_>) -> (Vec<f64>, Vec<f64>) {
        let (k, n) = (w.fan_in, w.fan_out);
        let mut wide = vec![0.0f32; n * k];
        widen(&OnCallingThread, w.kind, &w.blocks.concat(), n, k, &mut wide).unwrap();
        let rows = xm.len() / k;
        let (mut y, mut magnitude) = (vec![0.0; rows * n], vec![0.0; rows * n]);
        for r in 0..rows {
            for o in 0..n {
                let terms = (0..k).map(|j| xm[r * k + j] * wide[o * k + j] as f64);
                y[r * n + o] = terms.clone().sum::<f64>() + w.bias.map_or(0.0, |b| b[o] as f64);
                magnitude[r * n + o] = terms.map(f64::abs).sum();
            }
        }
        (y, magnitude)
    }

    /// Within f32's rounding of sums of `magnitude`.
    pub(crate) fn assert_near(got: &[f32], (want, magnitude): &(Vec<f64>, Vec<f64>)) {
        for ((&got, &want), &m) in got.iter().zip(want).zip(magnitude) {
            assert!(
                (got as f64 - want).abs() <= 1e-5 * (m + want.abs()) + 1e-30,
                "{got} vs {want} (terms {m})"
            );
        }
    }

    /// The layer of `kind` on each (rows, fan_in, fan_out) shape, with and without a bias, near
    /// `reference` (its float64 sums with x as the kernel multiplies it).
    pub(crate) fn assert_matches_reference(
        kind: BlockKind,
        shapes: &[(usize, usize, usize)],
        reference: impl Fn(&[f32], &KQuantWeights<'_>) -> (Vec<f64>, Vec<f64>),
    ) {
        for &(rows, k, n) in shapes {
            let x: Vec<f32> =
                values(rows * k, 1).iter().enumerate().map(|(i, v)| v * (1 + i / 40) as f32).collect();
            let (b, bias) = (blocks(kind, n, k, 2), values(n, 3));
            for bias in [None, Some(bias.as_slice())] {
                let w = KQuantWeights { kind, blocks: vec![&b], bias, fan_in: k, fan_out: n };
                let mut y = vec![f32::NAN; rows * n];
                linear_kquant(&x, &w, &mut y).unwrap();
                assert_near(&y, &reference(&x, &w));
            }
        }
    }

    /// Every row of x through `w` at once, on two parts, and each row alone on the calling thread:
    /// the same bits. The rows' outputs together.
    pub(crate) fn rows_alone_as_in_a_batch(x: &[f32], w: &KQuantWeights<'_>) -> Vec<f32> {
        let (k, n) = (w.fan_in, w.fan_out);
        let mut all = vec![0.0; x.len() / k * n];
        linear_kquant_on(&TwoParts, x, w, &mut all).unwrap();
        for (r, row) in x.chunks_exact(k).enumerate() {
            let mut one = vec![0.0; n];
            linear_kquant(row, w, &mut one).unwrap();
            assert_eq!(one, all[r * n..][..n], "{:?} row {r}", w.kind);
        }
        all
    }

    #[test]
    fn matches_a_float64_reference_of_the_widened_weights() {
        for kind in [BlockKind::Q4K, BlockKind::Q6K, BlockKind::Q5_0] {
            let q5 = if kind == BlockKind::Q5_0 { vec![(1, 32, 5), (5, 96, 6), (2, 896, 3)] } else { vec![] };
            let shapes: Vec<_> = [(1, 256, 4), (1, 512, 7), (3, 256, 9), (6, 768, 5), (17, 256, 3)]
                .into_iter()
                .chain(q5)
                .collect();
            assert_matches_reference(kind, &shapes, reference);
        }
    }

    /// The AVX2 half against the plain loop, and a row's bits the same alone as beside other
    /// rows, on one thread or several.
    #[test]
    fn the_halves_agree_and_a_row_gets_the_same_bits_alone_beside_other_rows_and_on_several_threads() {
        for kind in [BlockKind::Q4K, BlockKind::Q6K, BlockKind::Q5_0] {
            let (k, n) = (512, 1030);
            let (x, b) = (values(7 * k, 6), blocks(kind, n, k, 7));
            let w = KQuantWeights { kind, blocks: vec![&b], bias: None, fan_in: k, fan_out: n };
            let all = rows_alone_as_in_a_batch(&x, &w);
            let mut plain = vec![f32::NAN; 7 * n];
            let out = SharedOutputs { ptr: plain.as_mut_ptr(), len: plain.len() };
            plain_outputs(&Int8Rows::of(&x, k, w.activation_block()), &w, 0..n, &out);
            let want = reference(&x, &w);
            assert_near(&all, &want);
            assert_near(&plain, &want);
        }
    }

    /// A layer's rows in several slices (projections the file holds apart, run as one) give the
    /// bits of the same rows in one slice, at one row and several.
    #[test]
    fn rows_split_between_slices_give_the_bits_of_one_slice() {
        for kind in BlockKind::ALL {
            let (k, n) = (512, 70);
            let b = blocks(kind, n, k, 11);
            let row_bytes = kind.row_bytes(k).unwrap();
            let (q, k_and_v) = b.split_at(40 * row_bytes);
            let (k_rows, v_rows) = k_and_v.split_at(18 * row_bytes);
            for rows in [1, 7] {
                let x = values(rows * k, 12);
                let (mut one, mut split) = (vec![0.0; rows * n], vec![f32::NAN; rows * n]);
                let w = KQuantWeights { kind, blocks: vec![&b], bias: None, fan_in: k, fan_out: n };
                linear_kquant_on(&TwoParts, &x, &w, &mut one).unwrap();
                let w = KQuantWeights { blocks: vec![q, k_rows, v_rows], ..w };
                linear_kquant_on(&TwoParts, &x, &w, &mut split).unwrap();
                assert_eq!(one, split, "{kind:?}, {rows} rows");
            }
        }
    }

    /// Where Q4_K goes to the VNNI half, the AVX2 half (what CPUs without VNNI run) on its own:
    /// near the reference, and a row's bits the same alone as beside other rows.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_half_of_q4_k_where_the_vnni_half_serves() {
        if !uses_q4k_lanes(BlockKind::Q4K) {
            return; // linear_kquant runs the AVX2 half itself (the test above)
        }
        let (k, n) = (512, 37);
        let (x, b) = (values(7 * k, 8), blocks(BlockKind::Q4K, n, k, 9));
        let w = KQuantWeights { kind: BlockKind::Q4K, blocks: vec![&b], bias: None, fan_in: k, fan_out: n };
        let avx2 = |x: &[f32]| {
            let mut y = vec![f32::NAN; x.len() / k * n];
            let out = SharedOutputs { ptr: y.as_mut_ptr(), len: y.len() };
            // SAFETY: uses_q4k_lanes says the CPU has AVX-512 (so AVX2, FMA, F16C); shapes as checked.
            unsafe { crate::linear_kquant_avx2::run_outputs(&Int8Rows::of(x, k, SUPER), &w, 0..n, &out) };
            y
        };
        let all = avx2(&x);
        assert_near(&all, &reference(&x, &w));
        for r in 0..7 {
            assert_eq!(avx2(&x[r * k..][..k]), all[r * n..][..n], "row {r}");
        }
    }

    /// The AVX2 quantizer gives the plain one's bits: values, scale and sums, with ties, zeros,
    /// NaN and infinities among the inputs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_quantizer_gives_the_plain_bits() {
        if !crate::vector::avx2_fma_available() {
            return;
        }
        let mut blocks: Vec<Vec<f32>> =
            (0..20).map(|s| values(256, 20 + s).iter().map(|v| v * 3.0).collect()).collect();
        // x / scale exactly k + 1/2 for many k: max 127 * 2, so scale 2 and x = 2k + 1
        blocks.push(
            (0..256).map(|i| if i == 0 { 254.0 } else { (i % 200) as f32 * 2.0 + 1.0 - 200.0 }).collect(),
        );
        blocks.push(vec![0.0; 256]);
        blocks.push((0..256).map(|i| if i % 7 == 0 { f32::NAN } else { i as f32 }).collect());
        blocks.push((0..256).map(|i| if i == 3 { f32::INFINITY } else { -(i as f32) }).collect());
        blocks.push((0..256).map(|i| (i as f32 - 128.0) * 1e-40).collect()); // subnormal
        for block in &blocks {
            for width in [32, 256] {
                for part in block.chunks_exact(width) {
                    let (mut a, mut b) = (vec![0i8; width], vec![0i8; width]);
                    let (mut sa, mut sb) = (vec![0i16; width / 16], vec![0i16; width / 16]);
                    let plain = quantize(part, &mut a, &mut sa);
                    // SAFETY: AVX2 (checked); whole runs of 32.
                    let vector = unsafe { crate::linear_kquant_avx2::quantize(part, &mut b, &mut sb) };
                    assert_eq!((plain.to_bits(), &a, &sa), (vector.to_bits(), &b, &sb), "{:?}", &part[..4]);
                }
            }
        }
    }

    #[test]
    fn q4k_lanes_put_each_run_of_16_where_the_vnni_half_reads_it() {
        let x: Vec<f32> = (0..512).map(|i| (i % 97) as f32 - 48.0).collect();
        let q = Int8Rows::of(&x, 512, SUPER);
        let lanes = q.q4k_lanes();
        assert_eq!(lanes.as_ptr() as usize % 64, 0);
        // SAFETY: the lines hold as many values as q.values.
        let lanes = unsafe { std::slice::from_raw_parts(lanes.as_ptr(), q.values.len()) };
        // each chunk's (64 inputs) first 16, then each one's second 16, and so on
        let starts = [0, 64, 128, 192, 16, 80, 144, 208, 32, 96, 160, 224, 48, 112, 176, 240];
        for s in 0..2 {
            for (run, at) in starts.into_iter().enumerate() {
                let want = &q.values[s * SUPER + at..][..16];
                assert_eq!(&lanes[s * SUPER + 16 * run..][..16], want, "super-block {s} run {run}");
            }
        }
    }

    #[test]
    fn extreme_inputs_do_not_overflow() {
        // Q6_K: every q 0 with scale -128 (the largest |(q - 32) * sc|); Q4_K: every nibble 15,
        // scale 63, no minimum; x all -3 (every xq -127)
        let k = 1024;
        let mut q6 = vec![0u8; k / SUPER * 210];
        for block in q6.chunks_exact_mut(210) {
            block[192..208].fill(0x80); // sc = -128; ql = qh = 0: q = 0, q - 32 = -32
            block[208..210].copy_from_slice(&f16::ONE.to_le_bytes());
        }
        let mut q4 = vec![0xFFu8; k / SUPER * 144];
        for block in q4.chunks_exact_mut(144) {
            block[0..2].copy_from_slice(&f16::ONE.to_le_bytes());
            block[2..4].copy_from_slice(&f16::ZERO.to_le_bytes());
        }
        let mut q5 = vec![0u8; k / 32 * 22]; // every q 0: q - 16 = -16
        for block in q5.chunks_exact_mut(22) {
            block[0..2].copy_from_slice(&f16::ONE.to_le_bytes());
        }
        let x = vec![-3.0f32; k];
        for (kind, b, want) in [
            (BlockKind::Q6K, &q6, -3.0 * -32.0 * -128.0),
            (BlockKind::Q4K, &q4, -3.0 * 15.0 * 63.0),
            (BlockKind::Q5_0, &q5, -3.0 * -16.0),
        ] {
            let w = KQuantWeights { kind, blocks: vec![b], bias: None, fan_in: k, fan_out: 1 };
            let mut y = [f32::NAN];
            linear_kquant(&x, &w, &mut y).unwrap();
            let want = want * k as f32; // within f32's rounding of the block scales (an overflow is far off)
            assert!((y[0] - want).abs() <= want.abs() * 1e-6, "{kind:?}: {} against {want}", y[0]);
        }
    }

    #[test]
    fn bad_shapes_are_errors_naming_the_argument() {
        let b = vec![0u8; 3 * 144];
        let ok =
            || KQuantWeights { kind: BlockKind::Q4K, blocks: vec![&b], bias: None, fan_in: 256, fan_out: 3 };
        let err =
            |w: &KQuantWeights<'_>, x: &[f32]| linear_kquant(x, w, &mut [0.0; 3]).unwrap_err().to_string();
        assert!(linear_kquant(&[0.0; 256], &ok(), &mut [0.0; 3]).is_ok());
        assert!(linear_kquant(
            &[0.0; 256],
            &KQuantWeights { blocks: vec![&b[..144], &b[144..]], ..ok() },
            &mut [0.0; 3]
        )
        .is_ok());
        assert!(err(&KQuantWeights { kind: BlockKind::Q6K, ..ok() }, &[0.0; 256]).starts_with("blocks:"));
        assert!(err(&KQuantWeights { blocks: vec![&b[..431]], ..ok() }, &[0.0; 256]).starts_with("blocks:"));
        // the right bytes in all, but a row split between two slices
        assert!(err(&KQuantWeights { blocks: vec![&b[..100], &b[100..]], ..ok() }, &[0.0; 256])
            .starts_with("blocks:"));
        assert!(err(&KQuantWeights { fan_in: 128, ..ok() }, &[0.0; 128]).starts_with("fan_in:"));
        let q5 = KQuantWeights {
            kind: BlockKind::Q5_0,
            blocks: vec![&b[..3 * 22]],
            bias: None,
            fan_in: 48,
            fan_out: 3,
        };
        assert!(err(&q5, &[0.0; 48]).starts_with("fan_in:"));
        assert!(err(&ok(), &[0.0; 255]).starts_with("x:"));
    }
}
