//! The decode attention of one sequence with AVX2 and FMA, for head dims that are a multiple of
//! 8: scores eight keys at a time (`hsum8`), the softmax on whole vectors, and each head's
//! weighted sum of values kept in registers across all keys. (Reading keys and values in blocks
//! of eight rows for all query heads at once measured no better at head dim 64 and 1.5x slower at
//! 16.) The portable loops spent ~60 cycles
//! a score at head dim 16: one dot's horizontal sum is a chain of dependent adds, the max and the
//! exp ran a lane at a time, and the output row was loaded and stored again for every key.
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `decode_attention`
//! checked.

use std::arch::x86_64::*;

use crate::attention::exp;
use crate::vector::avx2::{hsum, hsum8};
use crate::vector::axpy;

/// A sequence's layout: cache rows of `row` floats (all kv heads), `group` query heads per kv
/// head, `len` keys.
pub struct Shape {
    pub row: usize,
    pub head_dim: usize,
    pub group: usize,
    pub len: usize,
    pub scale: f32,
}

/// out [num_q_heads, head_dim] += softmax(q k^T * scale) v over the pages (first position,
/// rows); `scores` is [num_q_heads, len] scratch. Scores and softmax on vectors, each query head
/// over its kv head's keys; the values in cache order, every row once, into each query head's
/// output row (which stays in L1).
#[inline(always)]
pub unsafe fn attend<'a>(
    shape: &Shape,
    q: &[f32],
    keys: impl Iterator<Item = (usize, &'a [f32])>,
    values: impl Iterator<Item = (usize, &'a [f32])>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, len, row, group) = (shape.head_dim, shape.len, shape.row, shape.group);
    for (first, rows) in keys {
        for (qh, qv) in q.chunks_exact(d).enumerate() {
            let dst = &mut scores[qh * len + first..][..rows.len() / row];
            page_scores(qv, &rows[qh / group * d..], row, shape.scale, dst);
        }
    }
    scores.chunks_exact_mut(len).for_each(|head| softmax(head));
    for (first, rows) in values {
        for (j, vals) in rows.chunks_exact(row).enumerate() {
            for (h, v) in vals.chunks_exact(d).enumerate() {
                for qh in h * group..(h + 1) * group {
                    axpy(scores[qh * len + first + j], v, &mut out[qh * d..][..d]);
                }
            }
        }
    }
}

/// dst[j] = q . k_j * scale for the keys starting `row` floats apart in `keys`, eight keys at a
/// time: eight vector sums in flight, reduced together by `hsum8`.
#[inline(always)]
unsafe fn page_scores(q: &[f32], keys: &[f32], row: usize, scale: f32, dst: &mut [f32]) {
    let n = dst.len();
    let part = |j: usize| {
        let k = keys.as_ptr().add(j * row);
        let mut acc = _mm256_setzero_ps();
        for c in (0..q.len()).step_by(8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(c)), _mm256_loadu_ps(k.add(c)), acc);
        }
        acc
    };
    let mut j = 0;
    while j + 8 <= n {
        let parts = std::array::from_fn(|i| part(j + i));
        _mm256_storeu_ps(dst.as_mut_ptr().add(j), _mm256_mul_ps(hsum8(&parts), _mm256_set1_ps(scale)));
        j += 8;
    }
    for (j, s) in dst.iter_mut().enumerate().skip(j) {
        *s = hsum(part(j)) * scale;
    }
}

/// softmax in place: x <- e^(x - max) / sum.
#[inline(always)]
unsafe fn softmax(x: &mut [f32]) {
    let body = x.len() - x.len() % 8;
    let p = x.as_mut_ptr();
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..body).step_by(8) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
    }
    let lanes: [f32; 8] = std::mem::transmute(m);
    let max = x[body..].iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max);
    let (vmax, mut sum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for i in (0..body).step_by(8) {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vmax));
        _mm256_storeu_ps(p.add(i), e);
        sum = _mm256_add_ps(sum, e);
    }
    let mut total = hsum(sum);
    for s in &mut x[body..] {
        *s = exp(*s - max);
        total += *s;
    }
    let inv = _mm256_set1_ps(1.0 / total);
    for i in (0..body).step_by(8) {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
    }
    x[body..].iter_mut().for_each(|s| *s /= total);
}

/// `attention::exp` on eight lanes (the same Cephes steps, with fused multiply-adds).
#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_setzero_ps());
    let n =
        _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), _mm256_set1_ps(0.5)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0));
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
}
