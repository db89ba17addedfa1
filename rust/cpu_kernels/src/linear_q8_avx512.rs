//! The AVX-512 half of `linear_q8`, for layers whose fan_in is a multiple of 16 on a CPU with
//! AVX-512F (others take `linear`'s AVX2 tiles). Each output's dot product is sixteen lanes of
//! partial sums over the inputs, sixteen int8 weights widened to f32 per step (sign-extended,
//! then converted: exact), reduced once at the end and scaled.
//!
//! One row streams the weights: eight outputs at a time, their values widened in registers.
//! Several rows (a batch's decode step, a prompt's chunk of up to `linear::CHUNK_ROWS`) widen a
//! tile of four weight rows into f32 once, then read it from L1 for every four rows: sixteen
//! sums in registers, each step four weight and four input loads for sixteen fused
//! multiply-adds. The AVX2 tiles widen the weights again for every three rows and keep twelve
//! 8-lane sums, which leaves an int8 layer at 32 rows slower than oneDNN's f32 matmul.
//!
//! Every output of every row is summed in one order (its sixteen-input steps in turn, lane by
//! lane; then `_mm512_reduce_add_ps`; then the scale and the bias), whatever the rows beside it,
//! the tile or the thread: a row gets the same bits alone or in a batch.
//!
//! Safety: every function here needs a CPU with AVX-512F, and the shapes `linear_q8` checked
//! with fan_in a multiple of `STEP`.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{RowWeights, SharedOutputs};
use crate::linear_q8::Q8Weights;

/// Inputs one step takes: sixteen int8 weights of each weight row.
pub(crate) const STEP: usize = 16;
/// Outputs one row's pass computes at once: eight sums in flight.
const ONE_ROW_OUTPUTS: usize = 8;
/// Weight rows a tile widens once for several rows.
const TILE_OUTPUTS: usize = 4;
/// Rows a tile's pass computes at once: with `TILE_OUTPUTS`, sixteen sums in registers.
const TILE_ROWS: usize = 4;
/// Inputs between two prefetches of the next tile's rows: a cache line of int8 weights.
const PREFETCH_EVERY: usize = 64;

/// `linear::run_outputs` for int8 weights with AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn run_outputs(
    x: &[f32],
    rows: usize,
    w: &Q8Weights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    let k = w.fan_in;
    let mut o = outputs.start;
    if rows == 1 {
        while o + ONE_ROW_OUTPUTS <= outputs.end {
            block::<ONE_ROW_OUTPUTS, 1, _>(x, w, &Packed(w), o, 0, y);
            o += ONE_ROW_OUTPUTS;
        }
        for o in o..outputs.end {
            block::<1, 1, _>(x, w, &Packed(w), o, 0, y);
        }
        return;
    }
    let mut scratch = vec![0.0f32; TILE_OUTPUTS * k];
    while o < outputs.end {
        let width = TILE_OUTPUTS.min(outputs.end - o);
        for a in 0..width {
            for i in (0..k).step_by(STEP) {
                _mm512_storeu_ps(scratch.as_mut_ptr().add(a * k + i), Packed(w).q16(o + a, i));
            }
        }
        let widened = Widened { values: &scratch, first: o, fan_in: k };
        let mut r = 0;
        while r < rows {
            let n = TILE_ROWS.min(rows - r);
            if width == TILE_OUTPUTS {
                rows_block::<TILE_OUTPUTS>(x, w, &widened, o, r, n, y);
            } else {
                for o in o..o + width {
                    rows_block::<1>(x, w, &widened, o, r, n, y);
                }
            }
            r += n;
        }
        o += width;
    }
}

/// Outputs o..o + W of rows r..r + n (n at most TILE_ROWS).
#[inline(always)]
unsafe fn rows_block<const W: usize>(
    x: &[f32],
    w: &Q8Weights<'_>,
    values: &Widened<'_>,
    o: usize,
    r: usize,
    n: usize,
    y: &SharedOutputs,
) {
    match n {
        4 => block::<W, 4, _>(x, w, values, o, r, y),
        3 => block::<W, 3, _>(x, w, values, o, r, y),
        2 => block::<W, 2, _>(x, w, values, o, r, y),
        _ => block::<W, 1, _>(x, w, values, o, r, y),
    }
}

/// Where a block reads its weights' values (as f32) from.
trait Values {
    /// Values (o, i..i + 16).
    unsafe fn q16(&self, o: usize, i: usize) -> __m512;
}

/// Straight from the int8 weights (one row: each value is used once).
struct Packed<'a, 'b>(&'a Q8Weights<'b>);

/// From a tile's values widened into f32 once, rows `first..` (several rows reuse them).
struct Widened<'a> {
    values: &'a [f32],
    first: usize,
    fan_in: usize,
}

impl Values for Packed<'_, '_> {
    /// Sixteen bytes sign-extended to sixteen lanes, then converted.
    #[inline(always)]
    unsafe fn q16(&self, o: usize, i: usize) -> __m512 {
        let w = self.0;
        let bytes = w.weight.as_ptr().add(o * w.fan_in + i) as *const __m128i;
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)))
    }
}

impl Values for Widened<'_> {
    #[inline(always)]
    unsafe fn q16(&self, o: usize, i: usize) -> __m512 {
        _mm512_loadu_ps(self.values.as_ptr().add((o - self.first) * self.fan_in + i))
    }
}

/// Outputs o..o + W of rows r..r + X.
#[inline(always)]
unsafe fn block<const W: usize, const X: usize, V: Values>(
    x: &[f32],
    w: &Q8Weights<'_>,
    values: &V,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let k = w.fan_in;
    let xp = x.as_ptr().add(r * k);
    let next = w.row_ptr(o + W) as *const i8; // the next block's weight rows follow these
    let mut acc = [[_mm512_setzero_ps(); X]; W];
    let mut i = 0;
    while i < k {
        if r == 0 && i % PREFETCH_EVERY == 0 {
            for a in 0..W {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(a * k + i));
            }
        }
        let mut xv = [_mm512_setzero_ps(); X];
        for (b, v) in xv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(xp.add(b * k + i));
        }
        for (a, sums) in acc.iter_mut().enumerate() {
            let q = values.q16(o + a, i);
            for (s, v) in sums.iter_mut().zip(&xv) {
                *s = _mm512_fmadd_ps(q, *v, *s);
            }
        }
        i += STEP;
    }
    for (a, sums) in acc.iter().enumerate() {
        for (b, s) in sums.iter().enumerate() {
            y.set((r + b) * w.fan_out + o + a, w.finish(o + a, _mm512_reduce_add_ps(*s)));
        }
    }
}
