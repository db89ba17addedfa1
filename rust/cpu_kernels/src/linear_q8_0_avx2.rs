//! The AVX2 half of `linear_q8_0`: a block's 32 int8 weights sign-extended once to two vectors
//! of sixteen i16 (`vpmovsxbw`) and multiplied with every row of the tile: `vpmaddwd` against
//! the row's int16 inputs sums adjacent products in i32, the two halves' sums are added (eight
//! lanes, each |.| <= 4 * 128 * 32767 < 2^24: exact in f32), and the lanes, times d and the
//! block's x scale, are added into the output's eight running sums. On several rows with AVX-512
//! VNNI, `vpdpwssd` does a `vpmaddwd` and its add in one (integer sums: the same bits).
//!
//! Each output is summed in one fixed order (its blocks in turn, lane by lane, then `hsum`'s
//! order) whatever the rows beside it or the tile: a row gets the same bits alone or in a batch.
//!
//! Safety: every function here needs a CPU with AVX2, FMA and F16C, and the shapes
//! `linear_kquant` checked for Q8_0.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{for_row_tiles, SharedOutputs};
use crate::linear_kquant::KQuantWeights;
use crate::linear_q8_0::{Int16Rows, BLOCK, BYTES};
use crate::vector::avx2::hsum;

/// Input rows of a tile (one weight row) with AVX2's 16 registers.
const TILE_ROWS: usize = 4;
/// The same where AVX-512VL gives these 8-lane instructions 32 registers: a verification step's
/// rows (a request and up to seven drafts) in one pass over each weight row.
const WIDE_TILE_ROWS: usize = 8;

/// `linear_q8_0::run_outputs` with AVX2, FMA and F16C (and for several rows the 32 registers of
/// AVX-512VL and VNNI's `vpdpwssd` where the CPU has them: the same integer sums, so the same bits).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn run_outputs(x: &Int16Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    if x.rows > 1 && crate::vector::avx512vl_vnni_available() {
        return run_outputs_vnni(x, w, outputs, y);
    }
    run::<TILE_ROWS, false>(x, w, outputs, y)
}

/// `run_outputs` with 32 vector registers and `vpdpwssd`. Safety: also AVX-512F, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn run_outputs_vnni(x: &Int16Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    run::<WIDE_TILE_ROWS, true>(x, w, outputs, y)
}

#[inline(always)]
unsafe fn run<const ROWS: usize, const VNNI: bool>(
    x: &Int16Rows,
    w: &KQuantWeights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    for_row_tiles!(outputs, x.rows, ROWS, |o, r| tile::<N, VNNI>(x, w, o, r, y));
}

/// Output o of rows r..r + X.
#[inline(always)]
unsafe fn tile<const X: usize, const VNNI: bool>(
    x: &Int16Rows,
    w: &KQuantWeights<'_>,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let k = w.fan_in;
    let blocks = k / BLOCK;
    let weights = w.row(o).as_ptr();
    let inputs: [*const i16; X] = std::array::from_fn(|c| x.values.as_ptr().add((r + c) * k));
    let x_scales: [*const f32; X] = std::array::from_fn(|c| x.scales.as_ptr().add((r + c) * blocks));
    let mut acc = [_mm256_setzero_ps(); X];
    for b in 0..blocks {
        let p = weights.add(b * BYTES);
        let low = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(2) as *const __m128i));
        let high = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(18) as *const __m128i));
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)));
        for (c, s) in acc.iter_mut().enumerate() {
            let xs = inputs[c].add(b * BLOCK) as *const __m256i;
            let dot = if VNNI {
                let half = _mm256_dpwssd_epi32(_mm256_setzero_si256(), low, _mm256_loadu_si256(xs));
                _mm256_dpwssd_epi32(half, high, _mm256_loadu_si256(xs.add(1)))
            } else {
                _mm256_add_epi32(
                    _mm256_madd_epi16(low, _mm256_loadu_si256(xs)),
                    _mm256_madd_epi16(high, _mm256_loadu_si256(xs.add(1))),
                )
            };
            *s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * *x_scales[c].add(b)), *s);
        }
    }
    for (c, s) in acc.iter().enumerate() {
        y.set((r + c) * w.fan_out + o, w.output(o, hsum(*s)));
    }
}
