//! The AVX2 half of `attention` (dispatch and its rules: `vector`). Each sequence with
//! intrinsics where its head dim is 8 to 128 in steps of 8, the portable kernel compiled for AVX2
//! otherwise. Each instance is compiled for one head dim (`V` vectors of `LANES`), so a query or
//! an output row lives in registers and every loop over it is unrolled: scores eight keys at a
//! time (eight independent sums, reduced together by `hsum8`), the softmax on whole vectors, and
//! the weighted sum of the values in `U` sets of accumulators (U keys in flight, so short rows are
//! not bound by the latency of one chain of fused multiply-adds).
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `decode_attention`
//! checked.

use std::arch::x86_64::*;

use crate::attention::{PagedCache, Sequence};
use crate::vector::avx2::{exp8, hsum, hsum8};
use crate::vector::{exp, LANES};

/// `attention::attend` with AVX2 and FMA: one sequence's query heads into `out`, which starts zeroed.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn attend_heads(
    seq: &Sequence<'_>,
    cache: &PagedCache<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    if serves(cache.head_dim) {
        attend(seq, cache, scale, scores, out)
    } else {
        crate::attention::attend(seq, cache, scale, scores, out)
    }
}

/// The head dims the intrinsics serve: 1 to 16 vectors.
fn serves(head_dim: usize) -> bool {
    head_dim.is_multiple_of(LANES) && (1..=16).contains(&(head_dim / LANES))
}

/// `attention::attend` with intrinsics, for a head dim that `serves`.
#[inline(always)]
unsafe fn attend(
    seq: &Sequence<'_>,
    cache: &PagedCache<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    scores.clear();
    scores.resize(seq.q.len() / seq.head_dim * seq.len, 0.0);
    macro_rules! by_vectors {
        ($($v:literal => $u:literal),*) => {
            match seq.head_dim / LANES {
                $($v => attend_with::<$v, $u>(seq, cache, scale, scores, out),)*
                _ => unreachable!("serves() admits 1 to 16 vectors"),
            }
        };
    }
    by_vectors!(1 => 8, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1, 9 => 1, 10 => 1, 11 => 1,
                12 => 1, 13 => 1, 14 => 1, 15 => 1, 16 => 1)
}

#[inline(always)]
unsafe fn attend_with<const V: usize, const U: usize>(
    seq: &Sequence<'_>,
    cache: &PagedCache<'_>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, len, row, group) = (LANES * V, seq.len, seq.row, seq.group);
    let (q, heads) = (seq.q, seq.q.len() / d);
    for (first, keys) in seq.pages(cache.keys) {
        let n = keys.len() / row;
        for qh in 0..heads {
            let mut qv = [_mm256_setzero_ps(); V];
            for (c, qc) in qv.iter_mut().enumerate() {
                *qc = _mm256_loadu_ps(q.as_ptr().add(qh * d + LANES * c));
            }
            let k = keys.as_ptr().add((seq.first_kv + qh / group) * d);
            page_scores::<V>(&qv, k, row, n, scale, scores.as_mut_ptr().add(qh * len + first));
        }
    }
    for head in scores.chunks_exact_mut(len) {
        seq.hide_scores(head);
        softmax(head);
        seq.zero_hidden(head);
    }
    for (first, values) in seq.pages(cache.values) {
        let n = values.len() / row;
        for qh in 0..heads {
            let v = values.as_ptr().add((seq.first_kv + qh / group) * d);
            let weights = scores.as_ptr().add(qh * len + first);
            page_values::<V, U>(weights, v, row, n, out.as_mut_ptr().add(qh * d));
        }
    }
}

/// dst[j] = q . k_j * scale for the n keys starting `row` floats apart at `k`, `LANES` keys at a
/// time.
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
    while j + LANES <= n {
        let mut parts = [_mm256_setzero_ps(); LANES];
        for (c, qc) in q.iter().enumerate() {
            for (i, part) in parts.iter_mut().enumerate() {
                *part = _mm256_fmadd_ps(*qc, _mm256_loadu_ps(k.add((j + i) * row + LANES * c)), *part);
            }
        }
        _mm256_storeu_ps(dst.add(j), _mm256_mul_ps(hsum8(&parts), scale8));
        j += LANES;
    }
    while j < n {
        let mut acc = _mm256_setzero_ps();
        for (c, qc) in q.iter().enumerate() {
            acc = _mm256_fmadd_ps(*qc, _mm256_loadu_ps(k.add(j * row + LANES * c)), acc);
        }
        *dst.add(j) = hsum(acc) * scale;
        j += 1;
    }
}

/// out[..LANES * V] += sum_j w[j] v_j for the n value rows starting `row` floats apart at `v`, U keys
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
        *a = _mm256_loadu_ps(out.add(LANES * c));
    }
    let mut j = 0;
    while j + U <= n {
        for (u, set) in acc.iter_mut().enumerate() {
            let p = _mm256_set1_ps(*w.add(j + u));
            for (c, a) in set.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(p, _mm256_loadu_ps(v.add((j + u) * row + LANES * c)), *a);
            }
        }
        j += U;
    }
    while j < n {
        let p = _mm256_set1_ps(*w.add(j));
        for (c, a) in acc[0].iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(p, _mm256_loadu_ps(v.add(j * row + LANES * c)), *a);
        }
        j += 1;
    }
    for c in 0..V {
        let mut total = acc[0][c];
        for set in &acc[1..] {
            total = _mm256_add_ps(total, set[c]);
        }
        _mm256_storeu_ps(out.add(LANES * c), total);
    }
}

/// softmax in place: x <- e^(x - max) / sum.
#[inline(always)]
unsafe fn softmax(x: &mut [f32]) {
    let body = x.len() - x.len() % LANES;
    let p = x.as_mut_ptr();
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..body).step_by(LANES) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
    }
    let lanes: [f32; LANES] = std::mem::transmute(m);
    let max = x[body..].iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max);
    let (vmax, mut sum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
    for i in (0..body).step_by(LANES) {
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
    for i in (0..body).step_by(LANES) {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), inv));
    }
    x[body..].iter_mut().for_each(|s| *s /= total);
}
