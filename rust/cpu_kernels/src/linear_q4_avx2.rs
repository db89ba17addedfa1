//! The AVX2 half of `linear_q4` for groups of at least 16 inputs (smaller ones take `linear`'s
//! generic kernel). With weight (o, j) = q * scale + offset, output o of row r is
//! `sum_g scale[o, g] * (x[r, g] . q[o, g]) + sum_g offset[o, g] * (sum of x[r, g])`: the inner
//! loop only widens eight nibbles at a time to f32 (a broadcast load, a shift per lane, a mask,
//! a conversion) and multiplies them into per-group sums; each group's scale is applied once, and
//! the offsets meet the inputs' group sums, computed once per call.
//!
//! Every output is summed in one fixed order (groups in turn; in a group, its sixteen-input
//! steps in turn, lane by lane; then the offsets' terms in group order) whatever the rows beside
//! it, the tile it falls in or the thread: a row gets the same bits alone or in a batch.
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `linear_q4` checked
//! (group a power of two of at least 16 dividing fan_in).

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{RowWeights, SharedOutputs};
use crate::linear_q4::Q4Weights;
use crate::vector::avx2::hsum;

/// Inputs one step widens: eight bytes of packed weights.
const STEP: usize = 16;
/// Weight rows of a tile (widened once when several rows use them).
const TILE_OUTPUTS: usize = 4;
/// Inputs between two prefetches of the next tile's rows: a cache line of packed weights.
const PREFETCH_EVERY: usize = 128;

/// `linear::run_outputs` for 4-bit weights with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn run_outputs(
    x: &[f32],
    rows: usize,
    w: &Q4Weights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    let (k, group) = (w.fan_in, w.group);
    let groups = k / group;
    let mut x_sums = vec![0.0f32; rows * groups];
    for (r, sums) in x_sums.chunks_exact_mut(groups).enumerate() {
        for (g, s) in sums.iter_mut().enumerate() {
            *s = sum(&x[r * k + g * group..][..group]);
        }
    }
    let mut scratch = vec![0.0f32; if rows > 1 { TILE_OUTPUTS * k } else { 0 }];
    let mut o = outputs.start;
    while o < outputs.end {
        let width = TILE_OUTPUTS.min(outputs.end - o);
        if rows == 1 {
            match width {
                TILE_OUTPUTS => block::<TILE_OUTPUTS, 1, _>(x, &x_sums, w, &Packed(w), o, 0, y),
                _ => (o..o + width).for_each(|o| block::<1, 1, _>(x, &x_sums, w, &Packed(w), o, 0, y)),
            }
        } else {
            // Several rows: the tile's values widened once, then read back for each pair of rows.
            for a in 0..width {
                for i in (0..k).step_by(STEP) {
                    let (q0, q1) = Packed(w).q16(o + a, i);
                    _mm256_storeu_ps(scratch.as_mut_ptr().add(a * k + i), q0);
                    _mm256_storeu_ps(scratch.as_mut_ptr().add(a * k + i + 8), q1);
                }
            }
            let widened = Widened { values: &scratch, first: o, fan_in: k };
            let mut r = 0;
            while r < rows {
                let pair = rows - r >= 2;
                for a in (0..width).step_by(2) {
                    match (pair, width - a >= 2) {
                        (true, true) => block::<2, 2, _>(x, &x_sums, w, &widened, o + a, r, y),
                        (true, false) => block::<1, 2, _>(x, &x_sums, w, &widened, o + a, r, y),
                        (false, true) => block::<2, 1, _>(x, &x_sums, w, &widened, o + a, r, y),
                        (false, false) => block::<1, 1, _>(x, &x_sums, w, &widened, o + a, r, y),
                    }
                }
                r += if pair { 2 } else { 1 };
            }
        }
        o += width;
    }
}

/// Where a block reads its weights' values q (as f32) from.
trait Values {
    /// Values (o, i..i + 16).
    unsafe fn q16(&self, o: usize, i: usize) -> (__m256, __m256);
}

/// Straight from the packed nibbles (one row: each value is used once).
struct Packed<'a, 'b>(&'a Q4Weights<'b>);

/// From a tile's values widened into f32 once, rows `first..` (several rows reuse them).
struct Widened<'a> {
    values: &'a [f32],
    first: usize,
    fan_in: usize,
}

impl Values for Widened<'_> {
    #[inline(always)]
    unsafe fn q16(&self, o: usize, i: usize) -> (__m256, __m256) {
        let p = self.values.as_ptr().add((o - self.first) * self.fan_in + i);
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
}

impl Values for Packed<'_, '_> {
    /// Each four bytes broadcast to the eight lanes, shifted by 4 * lane and masked (no shuffles).
    #[inline(always)]
    unsafe fn q16(&self, o: usize, i: usize) -> (__m256, __m256) {
        let w = self.0;
        let words = w.packed.as_ptr().add((o * w.fan_in + i) / 2) as *const i32;
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(0xF);
        let widen = |word: i32| {
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask))
        };
        (widen(words.read_unaligned()), widen(words.add(1).read_unaligned()))
    }
}

/// Outputs o..o + W of rows r..r + X.
#[inline(always)]
unsafe fn block<const W: usize, const X: usize, V: Values>(
    x: &[f32],
    x_sums: &[f32],
    w: &Q4Weights<'_>,
    values: &V,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let (k, group) = (w.fan_in, w.group);
    let groups = k / group;
    let xp = x.as_ptr().add(r * k);
    let next = w.row_ptr(o + W) as *const i8; // the next tile's rows follow this tile's
    let mut acc = [[_mm256_setzero_ps(); X]; W];
    for g in 0..groups {
        let mut in_group = [[_mm256_setzero_ps(); X]; W];
        let mut i = g * group;
        while i < (g + 1) * group {
            if r == 0 && i % PREFETCH_EVERY == 0 {
                for a in 0..W {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(a * k / 2 + i / 2));
                }
            }
            let mut xv = [[_mm256_setzero_ps(); 2]; X];
            for (b, v) in xv.iter_mut().enumerate() {
                *v = [_mm256_loadu_ps(xp.add(b * k + i)), _mm256_loadu_ps(xp.add(b * k + i + 8))];
            }
            for (a, sums) in in_group.iter_mut().enumerate() {
                let (q0, q1) = values.q16(o + a, i);
                for (s, v) in sums.iter_mut().zip(&xv) {
                    *s = _mm256_fmadd_ps(q1, v[1], _mm256_fmadd_ps(q0, v[0], *s));
                }
            }
            i += STEP;
        }
        for (a, (sums, partial)) in acc.iter_mut().zip(&in_group).enumerate() {
            let scale = _mm256_set1_ps(w.scales[(o + a) * groups + g]);
            for (s, p) in sums.iter_mut().zip(partial) {
                *s = _mm256_fmadd_ps(*p, scale, *s);
            }
        }
    }
    for (a, sums) in acc.iter().enumerate() {
        let offsets = &w.offsets[(o + a) * groups..][..groups];
        for (b, s) in sums.iter().enumerate() {
            let mut total = hsum(*s);
            for (off, xs) in offsets.iter().zip(&x_sums[(r + b) * groups..][..groups]) {
                total += off * xs;
            }
            y.set((r + b) * w.fan_out + o + a, w.finish(o + a, total));
        }
    }
}

/// The sum of `v` (a group: a multiple of 16 values), in a fixed order.
#[inline(always)]
unsafe fn sum(v: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for c in v.chunks_exact(8) {
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(c.as_ptr()));
    }
    hsum(acc)
}
