//! The decode attention of one sequence with AVX2 and FMA, for head dims of 8 to 128 in steps of
//! 8. Each instance is compiled for one head dim (`V` vectors of 8 lanes), so a query or an
//! output row lives in registers and every loop over it is unrolled: scores eight keys at a time
//! (eight independent sums, reduced together by `hsum8`), the softmax on whole vectors, and the
//! weighted sum of the values in `U` sets of accumulators (U keys in flight, so short rows are
//! not bound by the latency of one chain of fused multiply-adds).
//!
//! No intrinsic may sit in a closure: a closure does not inherit `#[target_feature]`, so its
//! intrinsics compile to calls. The previous version ran its softmax in one and took ~90
//! instructions a score at head dim 16 (callgrind, 256 sequences x 48 keys); this one ~30, the
//! softmax included.
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `decode_attention`
//! checked.

use std::arch::x86_64::*;

use crate::attention::exp;
use crate::vector::avx2::{hsum, hsum8};

/// A sequence's layout: cache rows of `row` floats (all kv heads), `group` query heads per kv
/// head, `len` keys.
pub struct Shape {
    pub row: usize,
    pub head_dim: usize,
    pub group: usize,
    pub len: usize,
    pub scale: f32,
}

/// The head dims this path serves.
pub fn serves(head_dim: usize) -> bool {
    head_dim % 8 == 0 && (8..=128).contains(&head_dim)
}

/// out [num_q_heads, head_dim] = softmax(q k^T * scale) v over the pages (first position, rows);
/// `scores` is [num_q_heads, len] scratch, `out` starts zeroed. `serves(shape.head_dim)` holds.
#[inline(always)]
pub unsafe fn attend<'a>(
    shape: &Shape,
    q: &[f32],
    pages: impl Iterator<Item = (usize, &'a [f32], &'a [f32])> + Clone,
    scores: &mut [f32],
    out: &mut [f32],
) {
    macro_rules! by_head_dim {
        ($($v:literal => $u:literal),*) => {
            match shape.head_dim / 8 {
                $($v => attend_with::<$v, $u>(shape, q, pages, scores, out),)*
                _ => unreachable!("serves() admits head dims of 8 to 128"),
            }
        };
    }
    by_head_dim!(1 => 8, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1, 9 => 1, 10 => 1, 11 => 1,
                 12 => 1, 13 => 1, 14 => 1, 15 => 1, 16 => 1)
}

#[inline(always)]
unsafe fn attend_with<'a, const V: usize, const U: usize>(
    shape: &Shape,
    q: &[f32],
    pages: impl Iterator<Item = (usize, &'a [f32], &'a [f32])> + Clone,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, len, row, group) = (8 * V, shape.len, shape.row, shape.group);
    let heads = q.len() / d;
    for (first, keys, _) in pages.clone() {
        let n = keys.len() / row;
        for qh in 0..heads {
            let mut qv = [_mm256_setzero_ps(); V];
            for (c, qc) in qv.iter_mut().enumerate() {
                *qc = _mm256_loadu_ps(q.as_ptr().add(qh * d + 8 * c));
            }
            let k = keys.as_ptr().add(qh / group * d);
            page_scores::<V>(&qv, k, row, n, shape.scale, scores.as_mut_ptr().add(qh * len + first));
        }
    }
    for head in scores.chunks_exact_mut(len) {
        softmax(head); // NOTE: not in a closure, which would compile without AVX2 (intrinsics as calls)
    }
    for (first, _, values) in pages {
        let n = values.len() / row;
        for qh in 0..heads {
            let v = values.as_ptr().add(qh / group * d);
            let weights = scores.as_ptr().add(qh * len + first);
            page_values::<V, U>(weights, v, row, n, out.as_mut_ptr().add(qh * d));
        }
    }
}

/// dst[j] = q . k_j * scale for the n keys starting `row` floats apart at `k`.
#[inline(always)]
unsafe fn page_scores<const V: usize>(
    q: &[__m256; V],
    k: *const f32,
    row: usize,
    n: usize,
    scale: f32,
    dst: *mut f32,
) {
    let scale8 = _mm256_set1_ps(scale);
    let mut j = 0;
    while j + 8 <= n {
        let mut parts = [_mm256_setzero_ps(); 8];
        for (c, qc) in q.iter().enumerate() {
            for (i, part) in parts.iter_mut().enumerate() {
                *part = _mm256_fmadd_ps(*qc, _mm256_loadu_ps(k.add((j + i) * row + 8 * c)), *part);
            }
        }
        _mm256_storeu_ps(dst.add(j), _mm256_mul_ps(hsum8(&parts), scale8));
        j += 8;
    }
    while j < n {
        let mut acc = _mm256_setzero_ps();
        for (c, qc) in q.iter().enumerate() {
            acc = _mm256_fmadd_ps(*qc, _mm256_loadu_ps(k.add(j * row + 8 * c)), acc);
        }
        *dst.add(j) = hsum(acc) * scale;
        j += 1;
    }
}

/// out[..8V] += sum_j w[j] v_j for the n value rows starting `row` floats apart at `v`, U keys
/// at a time into U sets of accumulators.
#[inline(always)]
unsafe fn page_values<const V: usize, const U: usize>(
    w: *const f32,
    v: *const f32,
    row: usize,
    n: usize,
    out: *mut f32,
) {
    let mut acc = [[_mm256_setzero_ps(); V]; U];
    for (c, a) in acc[0].iter_mut().enumerate() {
        *a = _mm256_loadu_ps(out.add(8 * c));
    }
    let mut j = 0;
    while j + U <= n {
        for (u, set) in acc.iter_mut().enumerate() {
            let p = _mm256_set1_ps(*w.add(j + u));
            for (c, a) in set.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(p, _mm256_loadu_ps(v.add((j + u) * row + 8 * c)), *a);
            }
        }
        j += U;
    }
    while j < n {
        let p = _mm256_set1_ps(*w.add(j));
        for (c, a) in acc[0].iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(p, _mm256_loadu_ps(v.add(j * row + 8 * c)), *a);
        }
        j += 1;
    }
    for c in 0..V {
        let mut total = acc[0][c];
        for set in &acc[1..] {
            total = _mm256_add_ps(total, set[c]);
        }
        _mm256_storeu_ps(out.add(8 * c), total);
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
