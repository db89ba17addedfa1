//! The AVX2 half of `linear_q4_blocks`, a pair of blocks (64 weights) a step, as `linear_q4_avx2`
//! multiplies its own layout: the two blocks' 16 bytes of nibbles, loaded side by side and read
//! as sixteen u16 lanes, give four vectors of nibbles by shifts of 0, 4, 8 and 12 and a mask
//! (Q4_0's 8 taken off in i16), in the order `PairedRows` stores x's pairs in; `vpmaddwd` against
//! sixteen int16 inputs sums adjacent products into i32, and the four sums add up to eight lanes,
//! the first four block 2t's and the last four block 2t + 1's (each |.| <= 8 * 15 * 32767 < 2^22:
//! exact in f32). Converted to f32, they are multiplied by [d of 2t four times, d of 2t + 1 four
//! times] times the blocks' x scales and added into the output's eight running sums; Q4_1's m
//! (in lanes 0 and 4, zeros elsewhere) times the blocks' input sums go to eight sums of their
//! own. On several rows with AVX-512 VNNI, `vpdpwssd` does a `vpmaddwd` and its add in one (the
//! same integer sums). A row with an odd number of blocks ends on a half pair: its other half
//! multiplies zeros with a scale of 0.
//!
//! One weight row a tile, its bytes asked for `PREFETCH_AHEAD` ahead: one sequential stream a
//! thread, what this host's memory serves best (`linear_kquant_avx2`).
//!
//! Each output is summed in one fixed order (its pairs in turn, lane by lane, then `hsum`'s
//! order, then the minimums' sums likewise) whatever the rows beside it or the tile: a row gets
//! the same bits alone or in a batch.
//!
//! Safety: every function here needs a CPU with AVX2, FMA and F16C, and the shapes
//! `linear_kquant` checked for Q4_0 or Q4_1.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::gguf_blocks::BlockKind;
use crate::linear::{for_row_tiles, SharedOutputs};
use crate::linear_kquant::KQuantWeights;
use crate::linear_kquant_avx2::PREFETCH_AHEAD;
use crate::linear_q4_avx2::pair_products;
use crate::linear_q4_blocks::{layout, PairedRows, BLOCK, PAIR, PAIR_LANES};
use crate::vector::avx2::hsum;

/// Input rows of a tile (one weight row) with AVX2's 16 registers.
const TILE_ROWS: usize = 4;
/// The same where AVX-512VL gives these 8-lane instructions 32 registers: a verification step's
/// rows (a request and up to seven drafts) in one pass over each weight row.
const WIDE_TILE_ROWS: usize = 8;

/// `linear_q4_blocks::run_outputs` with AVX2, FMA and F16C (and for several rows the 32
/// registers of AVX-512VL and VNNI's `vpdpwssd` where the CPU has them: the same integer sums).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn run_outputs(x: &PairedRows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    if x.rows > 1 && crate::vector::avx512vl_vnni_available() {
        return run_outputs_vnni(x, w, outputs, y);
    }
    match w.kind {
        BlockKind::Q4_1 => run::<TILE_ROWS, false, true>(x, w, outputs, y),
        _ => run::<TILE_ROWS, false, false>(x, w, outputs, y),
    }
}

/// `run_outputs` with 32 vector registers and `vpdpwssd`. Safety: also AVX-512F, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn run_outputs_vnni(x: &PairedRows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    match w.kind {
        BlockKind::Q4_1 => run::<WIDE_TILE_ROWS, true, true>(x, w, outputs, y),
        _ => run::<WIDE_TILE_ROWS, true, false>(x, w, outputs, y),
    }
}

#[inline(always)]
unsafe fn run<const ROWS: usize, const VNNI: bool, const MIN: bool>(
    x: &PairedRows,
    w: &KQuantWeights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    for_row_tiles!(outputs, x.rows, ROWS, |o, r| tile::<N, VNNI, MIN>(x, w, o, r, y));
}

/// The f16 at `p` and, where `second`, the one at `p + bytes`, as f32 lanes [first, second, 0, 0].
#[inline(always)]
unsafe fn two_f16(p: *const u8, bytes: usize, second: bool) -> __m128 {
    let first = (p as *const u16).read_unaligned() as i32;
    let second = if second { ((p.add(bytes) as *const u16).read_unaligned() as i32) << 16 } else { 0 };
    _mm_cvtph_ps(_mm_cvtsi32_si128(first | second))
}

/// Output o of rows r..r + X; `MIN`: Q4_1 (a minimum a block), else Q4_0.
#[inline(always)]
unsafe fn tile<const X: usize, const VNNI: bool, const MIN: bool>(
    x: &PairedRows,
    w: &KQuantWeights<'_>,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let (blocks, bytes) = (w.fan_in / BLOCK, w.kind.weights_and_bytes().1);
    let qs_at = layout(w.kind).0;
    let weights = w.row(o).as_ptr();
    let inputs: [*const i16; X] = std::array::from_fn(|c| x.values.as_ptr().add((r + c) * x.pairs * PAIR));
    let x_scales: [*const f32; X] =
        std::array::from_fn(|c| x.scales.as_ptr().add((r + c) * x.pairs * PAIR_LANES));
    let x_sums: [*const f32; X] =
        std::array::from_fn(|c| x.sums.as_ptr().wrapping_add((r + c) * x.pairs * PAIR_LANES));
    let mut acc = [_mm256_setzero_ps(); X];
    let mut mins = [_mm256_setzero_ps(); X];
    let mask = _mm256_set1_epi16(0x0F);
    let eight = _mm256_set1_epi16(8);
    let spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1); // [a, b, ..] -> a four times, b four times
    let sparse = _mm256_setr_epi32(0, 2, 2, 2, 1, 2, 2, 2); // [a, b, 0, 0] -> a, 0, 0, 0, b, 0, 0, 0
    for t in 0..x.pairs {
        let p = weights.add(2 * t * bytes);
        if r == 0 {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_AHEAD) as *const i8);
        }
        let whole = 2 * t + 1 < blocks;
        let first = _mm_loadu_si128(p.add(qs_at) as *const __m128i);
        let second =
            if whole { _mm_loadu_si128(p.add(bytes + qs_at) as *const __m128i) } else { _mm_setzero_si128() };
        let v = _mm256_set_m128i(second, first);
        let mut q = [
            _mm256_and_si256(v, mask),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
            _mm256_and_si256(_mm256_srli_epi16::<8>(v), mask),
            _mm256_srli_epi16::<12>(v),
        ];
        if !MIN {
            q = q.map(|q| _mm256_sub_epi16(q, eight));
        }
        let d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two_f16(p, bytes, whole)), spread);
        for (c, s) in acc.iter_mut().enumerate() {
            let xs = inputs[c].add(t * PAIR) as *const __m256i;
            let dot = if VNNI {
                let sum = _mm256_dpwssd_epi32(_mm256_setzero_si256(), q[0], _mm256_loadu_si256(xs));
                let sum = _mm256_dpwssd_epi32(sum, q[1], _mm256_loadu_si256(xs.add(1)));
                let sum = _mm256_dpwssd_epi32(sum, q[2], _mm256_loadu_si256(xs.add(2)));
                _mm256_dpwssd_epi32(sum, q[3], _mm256_loadu_si256(xs.add(3)))
            } else {
                pair_products(&q, xs)
            };
            let scale = _mm256_mul_ps(d, _mm256_loadu_ps(x_scales[c].add(t * PAIR_LANES)));
            *s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *s);
        }
        if MIN {
            let m = _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(two_f16(p.add(2), bytes, whole)), sparse);
            for (c, s) in mins.iter_mut().enumerate() {
                *s = _mm256_fmadd_ps(m, _mm256_loadu_ps(x_sums[c].add(t * PAIR_LANES)), *s);
            }
        }
    }
    for c in 0..X {
        let total = if MIN { hsum(acc[c]) + hsum(mins[c]) } else { hsum(acc[c]) };
        y.set((r + c) * w.fan_out + o, w.output(o, total));
    }
}
