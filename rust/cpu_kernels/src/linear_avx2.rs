//! The AVX2 half of `linear` and `linear_q8` (dispatch and its rules: `vector`): tiles of
//! `TILE_OUTPUTS` weight rows by up to `TILE_ROWS` input rows, up to twelve sums in registers, each
//! weight vector loaded (f32, or int8 widened to f32: `RowWeights::load8`) once per tile and
//! each input vector once per tile's weight rows.
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `linear` checked.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{RowWeights, SharedOutputs, TILE_OUTPUTS};
use crate::vector::avx2::hsum;
use crate::vector::LANES;

/// Input rows a tile holds: with `TILE_OUTPUTS` = 4, twelve accumulators, three input vectors and
/// a weight vector, the sixteen vector registers. A pass over a tile's weights (from L1 after
/// the first) is bound by the FMA's latency when it has few sums in flight, so rows go three at a
/// time, the last two or one together: three rows cost about what two do, where a pair and then
/// a single row cost half as much again.
const TILE_ROWS: usize = 3;

/// Bytes of a cache line: eight weight rows of eight floats each step are four lines.
const CACHE_LINE: usize = 64;

/// `linear::run_outputs` with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn run_outputs<Wt: RowWeights>(
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
        tile::<TILE_OUTPUTS, Wt>(x, rows, w, o, y);
        o += TILE_OUTPUTS;
    }
    for o in o..outputs.end {
        tile::<1, Wt>(x, rows, w, o, y);
    }
}

/// Outputs o..o + W of every row.
#[inline(always)]
unsafe fn tile<const W: usize, Wt: RowWeights>(x: &[f32], rows: usize, w: &Wt, o: usize, y: &SharedOutputs) {
    let mut r = 0;
    while r + TILE_ROWS <= rows {
        block::<W, TILE_ROWS, Wt>(x, w, o, r, y);
        r += TILE_ROWS;
    }
    match rows - r {
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
