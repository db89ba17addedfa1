//! The AVX2 half of `lora` (dispatch and its rules: `vector`), over blocks of up to `BLOCK`
//! tokens of one slot, so each vector of an adapter's B, read from cache once, serves every token
//! of the block (B is most of the bytes).
//!
//! Safety: every function here needs a CPU with AVX2 and FMA, and the shapes `add_lora` checked.

use std::arch::x86_64::*;

use crate::lora::{Block, LoraWeights, SharedRows, BLOCK};
use crate::vector::avx2::hsum;
use crate::vector::LANES;

/// Outputs `expand` sums in registers at a time: two vectors.
const OUTPUTS: usize = 2 * LANES;

const _: () = assert!(BLOCK == 4, "run_blocks has an `expand` for blocks of 1 to 4 tokens");

/// `lora::run_blocks` with AVX2 and FMA: each block's tokens get their shrunk inputs (`rank`
/// each), then B expanded into their rows.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn run_blocks(x: &[f32], blocks: &[Block<'_>], w: &LoraWeights<'_>, y: &SharedRows) {
    let (rank, fan_in, fan_out) = (w.rank, w.fan_in, w.fan_out);
    let mut xa = vec![0.0f32; BLOCK * rank];
    for &(slot, block) in blocks {
        let a = &w.a[slot * rank * fan_in..][..rank * fan_in];
        let b = &w.b_scaled[slot * rank * fan_out..][..rank * fan_out];
        for (i, &t) in block.iter().enumerate() {
            shrink(a, &x[t * fan_in..][..fan_in], &mut xa[i * rank..][..rank]);
        }
        match block.len() {
            4 => expand::<4>(&xa, block, b, y, rank, fan_out),
            3 => expand::<3>(&xa, block, b, y, rank, fan_out),
            2 => expand::<2>(&xa, block, b, y, rank, fan_out),
            _ => expand::<1>(&xa, block, b, y, rank, fan_out),
        }
    }
}

/// xa[r] = a[r] . x for each row r of `a`, four rows at a time (four sums in flight, each load
/// of x serving four rows), then the rows left one by one.
#[inline(always)]
unsafe fn shrink(a: &[f32], x: &[f32], xa: &mut [f32]) {
    let n = x.len();
    let mut r = 0;
    while r + 4 <= xa.len() {
        let sums = dots::<4>(&a[r * n..][..4 * n], x);
        xa[r..r + 4].copy_from_slice(&sums);
        r += 4;
    }
    for r in r..xa.len() {
        xa[r] = dots::<1>(&a[r * n..][..n], x)[0];
    }
}

/// The dot products of x with the R consecutive rows of `rows`.
#[inline(always)]
unsafe fn dots<const R: usize>(rows: &[f32], x: &[f32]) -> [f32; R] {
    let n = x.len();
    let body = n - n % LANES;
    let (xp, ap) = (x.as_ptr(), rows.as_ptr());
    let mut acc = [_mm256_setzero_ps(); R];
    let mut k = 0;
    while k < body {
        let xv = _mm256_loadu_ps(xp.add(k));
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(j * n + k)), xv, *acc);
        }
        k += LANES;
    }
    let mut out = [0.0f32; R];
    for (j, o) in out.iter_mut().enumerate() {
        let tail: f32 = (body..n).map(|k| rows[j * n + k] * x[k]).sum();
        *o = hsum(acc[j]) + tail;
    }
    out
}

/// y[tokens[t]] += sum over r of xa[t][r] * b[r] for the T tokens of a block, `OUTPUTS` outputs
/// at a time summed over r in registers; the outputs past the last of those one by one. The
/// block's rows of `y` are written by this thread only.
#[inline(always)]
unsafe fn expand<const T: usize>(
    xa: &[f32],
    tokens: &[usize],
    b: &[f32],
    y: &SharedRows,
    rank: usize,
    n: usize,
) {
    let body = n - n % OUTPUTS;
    let (bp, yp) = (b.as_ptr(), y.ptr);
    let mut o = 0;
    while o < body {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for r in 0..rank {
            let b0 = _mm256_loadu_ps(bp.add(r * n + o));
            let b1 = _mm256_loadu_ps(bp.add(r * n + o + LANES));
            for (t, acc) in acc.iter_mut().enumerate() {
                let v = _mm256_set1_ps(xa[t * rank + r]);
                acc[0] = _mm256_fmadd_ps(v, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(v, b1, acc[1]);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            let row = yp.add(tokens[t] * n + o);
            _mm256_storeu_ps(row, _mm256_add_ps(_mm256_loadu_ps(row), acc[0]));
            _mm256_storeu_ps(row.add(LANES), _mm256_add_ps(_mm256_loadu_ps(row.add(LANES)), acc[1]));
        }
        o += OUTPUTS;
    }
    for (t, &token) in tokens.iter().enumerate() {
        let row = y.row(token, n);
        for (o, out) in row.iter_mut().enumerate().skip(body) {
            *out += (0..rank).map(|r| xa[t * rank + r] * b[r * n + o]).sum::<f32>();
        }
    }
}
