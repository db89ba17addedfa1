//! The AVX2 half of `linear_q8`: `linear_avx2`'s tiles, with each weight vector eight int8
//! values widened to f32 in registers (`vpmovsxbd`, `vcvtdq2ps`) before the multiply-add.
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `linear_q8` checked.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{SharedOutputs, TILE_OUTPUTS};
use crate::linear_q8::Q8Weights;
use crate::vector::avx2::hsum;
use crate::vector::LANES;

const TILE_ROWS: usize = 2;
const CACHE_LINE: usize = 64;

/// `linear_q8::run_outputs` with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn run_outputs(
    x: &[f32],
    rows: usize,
    w: &Q8Weights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    let mut o = outputs.start;
    if rows == 1 {
        while o + 2 * TILE_OUTPUTS <= outputs.end {
            block::<{ 2 * TILE_OUTPUTS }, 1>(x, w, o, 0, y);
            o += 2 * TILE_OUTPUTS;
        }
    }
    while o + TILE_OUTPUTS <= outputs.end {
        tile::<TILE_OUTPUTS>(x, rows, w, o, y);
        o += TILE_OUTPUTS;
    }
    for o in o..outputs.end {
        tile::<1>(x, rows, w, o, y);
    }
}

#[inline(always)]
unsafe fn tile<const W: usize>(x: &[f32], rows: usize, w: &Q8Weights<'_>, o: usize, y: &SharedOutputs) {
    let mut r = 0;
    while r + TILE_ROWS <= rows {
        block::<W, TILE_ROWS>(x, w, o, r, y);
        r += TILE_ROWS;
    }
    for r in r..rows {
        block::<W, 1>(x, w, o, r, y);
    }
}

/// Outputs o..o + W of rows r..r + X: `hsum` of the vector sum over the full vectors of fan_in,
/// plus the tail's products in order, times the output's scale, plus the bias.
#[inline(always)]
unsafe fn block<const W: usize, const X: usize>(
    x: &[f32],
    w: &Q8Weights<'_>,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let k = w.fan_in;
    let body = k - k % LANES;
    let (xp, wp) = (x.as_ptr().add(r * k), w.weight.as_ptr().add(o * k));
    let mut acc = [[_mm256_setzero_ps(); X]; W];
    let next = wp.wrapping_add(W * k) as *const i8;
    let prefetch = r == 0;
    // A step reads eight int8 weights of each of W rows: W / 8 cache lines of the next tile
    // asked for per step keep pace with it.
    let lines_per_step = W.div_ceil(8);
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
            let q = _mm_loadl_epi64(wp.add(a * k + i) as *const __m128i);
            let wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            for (s, v) in sums.iter_mut().zip(&xv) {
                *s = _mm256_fmadd_ps(wv, *v, *s);
            }
        }
        i += LANES;
    }
    for (a, sums) in acc.iter().enumerate() {
        let q_row = &w.weight[(o + a) * k..][..k];
        for (b, s) in sums.iter().enumerate() {
            let x_row = &x[(r + b) * k..][..k];
            let mut total = hsum(*s);
            for j in body..k {
                total += q_row[j] as f32 * x_row[j];
            }
            total *= w.scales[o + a];
            if let Some(bias) = w.bias {
                total += bias[o + a];
            }
            y.set((r + b) * w.fan_out + o + a, total);
        }
    }
}
