//! The AVX2 half of `linear` and `linear_q8` (dispatch and its rules: `vector`): tiles of
//! `TILE_OUTPUTS` weight rows by a few input rows, the sums in registers, each weight vector loaded
//! (f32, or int8 widened to f32: `RowWeights::load8`) once per pass over a tile and each input
//! vector once per pass's weight rows. Every output is the same steps whatever the tile (an
//! 8-lane sum over fan_in, `hsum`, the tail's products in order, `finish`), so a row's outputs
//! have the same bits alone or beside other rows, with 16 vector registers or 32.
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `linear` checked.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{RowWeights, SharedOutputs, TILE_OUTPUTS};
use crate::vector::avx2::hsum;
use crate::vector::LANES;

/// Input rows a pass over a tile holds with AVX2's sixteen vector registers: twelve sums, three
/// input vectors and a weight vector. A pass is bound by the FMA's latency when it has few sums
/// in flight, so rows go three at a time, the last two or one together.
const TILE_ROWS: usize = 3;

/// Input rows a pass holds where AVX-512VL gives these same 8-lane instructions 32 registers:
/// twenty-four sums, six input vectors and a weight vector. A verification step's rows (a
/// request and its drafts) then take one pass: the first pass over a tile waits on memory for its
/// weights, and every further pass was arithmetic the memory stream did not overlap.
const WIDE_TILE_ROWS: usize = 6;

/// Bytes of a cache line: eight weight rows of eight floats each step are four lines.
const CACHE_LINE: usize = 64;

/// `linear::run_outputs` with AVX2 and FMA (and the 32 registers of AVX-512VL where it has them).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn run_outputs<Wt: RowWeights>(
    x: &[f32],
    rows: usize,
    w: &Wt,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    if rows > 1 && crate::vector::avx512vl_available() {
        return run_outputs_32_registers(x, rows, w, outputs, y);
    }
    tiles::<TILE_ROWS, Wt>(x, rows, w, outputs, y)
}

/// `run_outputs` with 32 vector registers. Safety: also AVX-512F and AVX-512VL.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn run_outputs_32_registers<Wt: RowWeights>(
    x: &[f32],
    rows: usize,
    w: &Wt,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    tiles::<WIDE_TILE_ROWS, Wt>(x, rows, w, outputs, y)
}

/// Outputs `outputs` of every row, up to X rows a pass.
#[inline(always)]
unsafe fn tiles<const X: usize, Wt: RowWeights>(
    x: &[f32],
    rows: usize,
    w: &Wt,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    let mut o = outputs.start;
    if rows == 1 {
        // One row: twice the weight rows per tile, so that eight sums are in flight as with two.
        while o + 2 * TILE_OUTPUTS <= outputs.end {
            block::<{ 2 * TILE_OUTPUTS }, 1, Wt>(x, w, o, 0, y);
            o += 2 * TILE_OUTPUTS;
        }
    }
    while o + TILE_OUTPUTS <= outputs.end {
        tile::<TILE_OUTPUTS, X, Wt>(x, rows, w, o, y);
        o += TILE_OUTPUTS;
    }
    for o in o..outputs.end {
        tile::<1, X, Wt>(x, rows, w, o, y);
    }
}

/// Outputs o..o + W of every row, X rows a pass, the last fewer.
#[inline(always)]
unsafe fn tile<const W: usize, const X: usize, Wt: RowWeights>(
    x: &[f32],
    rows: usize,
    w: &Wt,
    o: usize,
    y: &SharedOutputs,
) {
    let mut r = 0;
    while r + X <= rows {
        block::<W, X, Wt>(x, w, o, r, y);
        r += X;
    }
    match rows - r {
        5 => block::<W, 5, Wt>(x, w, o, r, y),
        4 => block::<W, 4, Wt>(x, w, o, r, y),
        3 => block::<W, 3, Wt>(x, w, o, r, y),
        2 => block::<W, 2, Wt>(x, w, o, r, y),
        1 => block::<W, 1, Wt>(x, w, o, r, y),
        _ => {}
    }
}

/// Outputs o..o + W of rows r..r + X: each one `hsum` of its vector sum over the full vectors of
/// fan_in, plus the tail's products in order, then `finish` (the same steps for every output).
#[inline(always)]
unsafe fn block<const W: usize, const X: usize, Wt: RowWeights>(
    x: &[f32],
    w: &Wt,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let k = w.fan_in();
    let body = k - k % LANES;
    let xp = x.as_ptr().add(r * k);
    let mut acc = [[_mm256_setzero_ps(); X]; W];
    // The next tile's weights follow this tile's in memory: the first pass over this tile
    // (r == 0) asks for them a little at a time, the whole next tile over the loop, so they are
    // on their way while this tile computes.
    let next = w.row_ptr(o + W) as *const i8;
    let prefetch = r == 0;
    let lines_per_step = (W * LANES * Wt::BITS / 8).div_ceil(CACHE_LINE);
    let mut line = 0;
    let mut i = 0;
    while i < body {
        if prefetch {
            for _ in 0..lines_per_step {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line * CACHE_LINE));
                line += 1;
            }
        }
        let mut xv = [_mm256_setzero_ps(); X];
        for (b, v) in xv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(xp.add(b * k + i));
        }
        for (a, sums) in acc.iter_mut().enumerate() {
            let wv = w.load8(o + a, i);
            for (s, v) in sums.iter_mut().zip(&xv) {
                *s = _mm256_fmadd_ps(wv, *v, *s);
            }
        }
        i += LANES;
    }
    for (a, sums) in acc.iter().enumerate() {
        for (b, s) in sums.iter().enumerate() {
            let x_row = &x[(r + b) * k..][..k];
            let mut total = hsum(*s);
            for (j, xj) in x_row.iter().enumerate().skip(body) {
                total += w.value(o + a, j) * xj;
            }
            y.set((r + b) * w.fan_out() + o + a, w.finish(o + a, total));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::tests::values;
    use crate::linear::LinearWeights;

    /// `run_outputs` as a CPU without AVX-512VL runs it.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_outputs_16_registers(x: &[f32], rows: usize, w: &LinearWeights<'_>, y: &SharedOutputs) {
        tiles::<TILE_ROWS, _>(x, rows, w, 0..w.fan_out(), y)
    }

    /// Six rows a pass with 32 registers give each output the bits of three a pass with 16.
    #[test]
    fn wide_tiles_give_the_bits_of_narrow_ones() {
        if !crate::vector::avx512vl_available() {
            return;
        }
        let (k, n) = (300, 1030);
        let wt = values(n * k, 5);
        let weights = LinearWeights { weight: &wt, bias: None, fan_in: k, fan_out: n };
        for rows in [2, 4, 5, 6, 7, 13] {
            let x = values(rows * k, 4);
            let (mut narrow, mut wide) = (vec![0.0f32; rows * n], vec![0.0f32; rows * n]);
            // SAFETY: the CPU has AVX2, FMA, AVX-512F and AVX-512VL; the shapes are consistent.
            unsafe {
                let out = SharedOutputs { ptr: narrow.as_mut_ptr(), len: narrow.len() };
                run_outputs_16_registers(&x, rows, &weights, &out);
                let out = SharedOutputs { ptr: wide.as_mut_ptr(), len: wide.len() };
                run_outputs_32_registers(&x, rows, &weights, 0..n, &out);
            }
            assert_eq!(narrow, wide, "{rows} rows");
        }
    }
}
