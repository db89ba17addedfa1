//! The AVX-512 half of `linear_q4`, for groups of at least 32 inputs on a CPU with AVX-512F
//! (others take the AVX2 half). With weight (o, j) = q * scale + offset, output o of row r is
//! `sum_g scale[o, g] * (x[r, g] . q[o, g]) + sum_g offset[o, g] * (sum of x[r, g])`, as there.
//! A step takes sixteen packed bytes (32 inputs): one zero-extending load puts byte b in lane b,
//! a mask leaves its low nibble (input 2b) and a shift its high one (input 2b + 1), each
//! converted to f32 once; they meet the row's even and odd inputs, split apart once per call.
//! The AVX2 half widens eight nibbles per broadcast, shift, mask and conversion; here each of
//! those instructions widens sixteen, which is what bounds a 4-bit layer at batch 1 (the
//! vector ports, not memory).
//!
//! Every output is summed in one fixed order (groups in turn; in a group, its 32-input steps in
//! turn, lane by lane, the even inputs before the odd; then the lanes in `_mm512_reduce_add_ps`'s
//! order; then the offsets' terms in group order) whatever the rows beside it, the tile it falls
//! in or the thread: a row gets the same bits alone or in a batch.
//!
//! Safety: every function here needs a CPU with AVX-512F, and the shapes `linear_q4` checked with
//! a group that is a power of two of at least 32 dividing fan_in.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{RowWeights, SharedOutputs};
use crate::linear_q4::Q4Weights;

/// Inputs one step widens: sixteen bytes of packed weights.
pub(crate) const STEP: usize = 32;
/// Weight rows of a tile (widened once when several rows use them).
const TILE_OUTPUTS: usize = 4;
/// Inputs between two prefetches of the next tile's rows: a cache line of packed weights.
const PREFETCH_EVERY: usize = 128;

/// `linear::run_outputs` for 4-bit weights with AVX-512F.
#[target_feature(enable = "avx512f")]
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
    // Each row as its even inputs, then its odd ones: the nibbles' order after a step's widening.
    let mut split = vec![0.0f32; rows * k];
    for (row, out) in x.chunks_exact(k).zip(split.chunks_exact_mut(k)) {
        let (even, odd) = out.split_at_mut(k / 2);
        for ((pair, e), o) in row.chunks_exact(2).zip(even).zip(odd) {
            *e = pair[0];
            *o = pair[1];
        }
    }
    let x = split.as_slice();
    let mut scratch = vec![0.0f32; if rows > 1 { TILE_OUTPUTS * k } else { 0 }];
    let mut o = outputs.start;
    while o < outputs.end {
        let width = TILE_OUTPUTS.min(outputs.end - o);
        if rows == 1 {
            match width {
                TILE_OUTPUTS => block::<TILE_OUTPUTS, 1, _>(x, &x_sums, w, &Packed(w), o, 0, y),
                _ => {
                    for o in o..o + width {
                        block::<1, 1, _>(x, &x_sums, w, &Packed(w), o, 0, y)
                    }
                }
            }
        } else {
            // Several rows: the tile's values widened once, then read back for every two rows.
            for a in 0..width {
                for i in (0..k).step_by(STEP) {
                    let (even, odd) = Packed(w).q32(o + a, i);
                    _mm512_storeu_ps(scratch.as_mut_ptr().add(a * k + i), even);
                    _mm512_storeu_ps(scratch.as_mut_ptr().add(a * k + i + 16), odd);
                }
            }
            let widened = Widened { values: &scratch, first: o, fan_in: k };
            let mut r = 0;
            while r < rows {
                // Four weight rows by up to two input rows: eight sums in registers, each with
                // its group's partial sum beside it.
                let n = 2.min(rows - r);
                if width == TILE_OUTPUTS {
                    match n {
                        2 => block::<TILE_OUTPUTS, 2, _>(x, &x_sums, w, &widened, o, r, y),
                        _ => block::<TILE_OUTPUTS, 1, _>(x, &x_sums, w, &widened, o, r, y),
                    }
                } else {
                    for o in o..o + width {
                        match n {
                            2 => block::<1, 2, _>(x, &x_sums, w, &widened, o, r, y),
                            _ => block::<1, 1, _>(x, &x_sums, w, &widened, o, r, y),
                        }
                    }
                }
                r += n;
            }
        }
        o += width;
    }
}

/// Where a block reads its weights' values q (as f32) from.
trait Values {
    /// Values (o, i..i + 32): those of the even inputs i, i + 2, ..., then of the odd ones.
    unsafe fn q32(&self, o: usize, i: usize) -> (__m512, __m512);
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
    unsafe fn q32(&self, o: usize, i: usize) -> (__m512, __m512) {
        let p = self.values.as_ptr().add((o - self.first) * self.fan_in + i);
        (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
    }
}

impl Values for Packed<'_, '_> {
    /// Sixteen bytes zero-extended to the sixteen lanes; each nibble then picks its value from
    /// the table 0.0..=15.0 (a permute reads only its index's low four bits: the low nibble as
    /// it is, the high one shifted down).
    #[inline(always)]
    unsafe fn q32(&self, o: usize, i: usize) -> (__m512, __m512) {
        let w = self.0;
        let bytes = w.packed.as_ptr().add((o * w.fan_in + i) / 2) as *const __m128i;
        let lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes));
        let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        (_mm512_permutexvar_ps(lanes, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(lanes), table))
    }
}

/// Outputs o..o + W of rows r..r + X; `x` holds each row's even inputs, then its odd ones.
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
    let mut acc = [[_mm512_setzero_ps(); X]; W];
    for g in 0..groups {
        let mut in_group = [[_mm512_setzero_ps(); X]; W];
        let mut i = g * group;
        while i < (g + 1) * group {
            if r == 0 && i % PREFETCH_EVERY == 0 {
                for a in 0..W {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(a * k / 2 + i / 2));
                }
            }
            let mut xv = [[_mm512_setzero_ps(); 2]; X];
            for (b, v) in xv.iter_mut().enumerate() {
                let even = xp.add(b * k + i / 2);
                *v = [_mm512_loadu_ps(even), _mm512_loadu_ps(even.add(k / 2))];
            }
            for (a, sums) in in_group.iter_mut().enumerate() {
                let (q0, q1) = values.q32(o + a, i);
                for (s, v) in sums.iter_mut().zip(&xv) {
                    *s = _mm512_fmadd_ps(q1, v[1], _mm512_fmadd_ps(q0, v[0], *s));
                }
            }
            i += STEP;
        }
        for (a, (sums, partial)) in acc.iter_mut().zip(&in_group).enumerate() {
            let scale = _mm512_set1_ps(w.scales[(o + a) * groups + g]);
            for (s, p) in sums.iter_mut().zip(partial) {
                *s = _mm512_fmadd_ps(*p, scale, *s);
            }
        }
    }
    for (a, sums) in acc.iter().enumerate() {
        let offsets = &w.offsets[(o + a) * groups..][..groups];
        for (b, s) in sums.iter().enumerate() {
            let mut total = _mm512_reduce_add_ps(*s);
            for (off, xs) in offsets.iter().zip(&x_sums[(r + b) * groups..][..groups]) {
                total += off * xs;
            }
            y.set((r + b) * w.fan_out + o + a, w.finish(o + a, total));
        }
    }
}

/// The sum of `v` (a group: a multiple of 32 values), in a fixed order.
#[inline(always)]
unsafe fn sum(v: &[f32]) -> f32 {
    let mut acc = _mm512_setzero_ps();
    for c in v.chunks_exact(16) {
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(c.as_ptr()));
    }
    _mm512_reduce_add_ps(acc)
}
