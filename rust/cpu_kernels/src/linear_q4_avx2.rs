//! The AVX2 half of `linear_q4` on int16 activations (groups of a multiple of 32 inputs), a pair
//! of blocks (64 weights, 32 bytes) a step. Read as sixteen u16 lanes, the bytes give four
//! vectors of nibbles by shifts of 0, 4, 8 and 12 and a mask: vector c holds weights 4i + c of
//! the pair in lane i, the order `QuantizedBlocks` stores x's pairs in. `vpmaddwd` multiplies
//! each with sixteen int16 inputs and sums adjacent lanes into i32; the four sums add up to
//! eight i32 lanes, the first four block 2t's and the last four block 2t + 1's, exact (at most
//! 8 * 15 * 32767 a lane). In f32 they are multiplied by the blocks' x scales (stored four to a
//! block) and added into the output's eight running sums times the weights' group scales. A row
//! with an odd number of blocks ends on a half pair: its last sixteen bytes are loaded alone and
//! the other half multiplies zeros.
//!
//! Each output is summed in one fixed order (pairs in turn, lane by lane; then the lanes in
//! `hsum`'s order; then the offsets' terms, `offsets_terms`'), whatever the rows beside it or
//! the tile: the tiles only choose which outputs and rows share a register's load.
//!
//! Safety: every function here needs a CPU with AVX2, FMA and F16C, and the shapes `linear_q4`
//! checked with a group that is a multiple of BLOCK.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::SharedOutputs;
use crate::linear_q4::{Q4Weights, QuantizedBlocks, BLOCK, PAIR, PAIR_SCALES};
use crate::vector::avx2::{hsum, load_f16, load_f32};

/// Weight rows of a tile at one input row: four streams of weights in flight.
const SINGLE_ROW_OUTPUTS: usize = 4;
/// Input rows of a tile at several input rows (one weight row): each block of weights, once
/// widened, meets this many rows. Four: on the AMD EPYC here (one thread, 576 x 196608), five rows
/// in one tile took 18.9 ms against 12.2 for four (its sums no longer fit the registers), five
/// as four and one 15.7-17.0, eight as two fours 21.2 against 28.3 as five and three.
const MULTI_ROW_ROWS: usize = 4;
/// Pairs between two prefetches of the next tile's rows: a cache line of packed weights.
const PREFETCH_EVERY: usize = 2;

/// `linear_q4::run_outputs` with AVX2, FMA and F16C (the weights' f16 scales).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn run_outputs(x: &QuantizedBlocks, w: &Q4Weights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    let mut o = outputs.start;
    if x.rows == 1 {
        while o < outputs.end {
            match outputs.end - o {
                1 => tile::<1, 1>(x, w, o, 0, y),
                2 => tile::<2, 1>(x, w, o, 0, y),
                3 => tile::<3, 1>(x, w, o, 0, y),
                _ => tile::<SINGLE_ROW_OUTPUTS, 1>(x, w, o, 0, y),
            }
            o += SINGLE_ROW_OUTPUTS;
        }
        return;
    }
    while o < outputs.end {
        let mut r = 0;
        while r < x.rows {
            match x.rows - r {
                1 => tile::<1, 1>(x, w, o, r, y),
                2 => tile::<1, 2>(x, w, o, r, y),
                3 => tile::<1, 3>(x, w, o, r, y),
                _ => tile::<1, MULTI_ROW_ROWS>(x, w, o, r, y),
            }
            r += MULTI_ROW_ROWS;
        }
        o += 1;
    }
}

/// The nibbles of 32 bytes (or of 16, the rest zeros, for a half pair), as sixteen u16 lanes:
/// vector c holds nibble c of each lane (weights 4i + c of the pair).
#[inline(always)]
unsafe fn widen(p: *const u8, half: bool) -> [__m256i; 4] {
    let v = if half {
        _mm256_zextsi128_si256(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_si256(p as *const __m256i)
    };
    let mask = _mm256_set1_epi16(0x0F);
    [
        _mm256_and_si256(v, mask),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
        _mm256_and_si256(_mm256_srli_epi16::<8>(v), mask),
        _mm256_srli_epi16::<12>(v),
    ]
}

/// Which of eight widened group scales each lane of a pair multiplies: pair u of
/// a run of eight groups of 32 takes groups 2u (lanes 0-3) and 2u + 1 (lanes 4-7); with groups of
/// 64 or more both blocks of pair u are in group u * PAIR / group.
static GROUPS_OF_32: [[i32; 8]; 4] =
    [[0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 3, 3, 3, 3], [4, 4, 4, 4, 5, 5, 5, 5], [6, 6, 6, 6, 7, 7, 7, 7]];
static ONE_GROUP: [[i32; 8]; 8] = {
    let mut lanes = [[0; 8]; 8];
    let mut g = 0;
    while g < 8 {
        lanes[g] = [g as i32; 8];
        g += 1;
    }
    lanes
};

/// The lanes of `GROUPS_OF_32` / `ONE_GROUP` for the pair at place u of its run of eight groups
/// (groups are powers of two of 32 or more: groups of 2^(6 + shift) inputs, shift >= 0, share
/// ONE_GROUP's entry u >> shift).
#[inline(always)]
unsafe fn pair_lanes(group: usize, u: usize, shift: u32) -> __m256i {
    let lanes = if group == BLOCK { &GROUPS_OF_32[u] } else { &ONE_GROUP[u >> shift] };
    _mm256_loadu_si256(lanes.as_ptr() as *const __m256i)
}

/// Output o's scales from group g on (up to eight; `groups` a row), widened from f16.
#[inline(always)]
unsafe fn eight_scales(w: &Q4Weights<'_>, groups: usize, o: usize, g: usize) -> __m256 {
    load_f16(w.scales.as_ptr().add(o * groups + g), groups - g)
}

/// Each row's offsets term: output o's offsets (f16, widened once) dotted with the group sums of
/// each of rows r..r + X, eight groups a step.
#[inline(always)]
unsafe fn offsets_terms<const X: usize>(
    w: &Q4Weights<'_>,
    x: &QuantizedBlocks,
    groups: usize,
    o: usize,
    r: usize,
) -> [f32; X] {
    let offsets = w.offsets_of(o).as_ptr();
    let mut acc = [_mm256_setzero_ps(); X];
    for g in (0..groups).step_by(8) {
        let wide = load_f16(offsets.add(g), groups - g);
        for (b, acc) in acc.iter_mut().enumerate() {
            let sums = load_f32(x.group_sums.as_ptr().add((r + b) * groups + g), groups - g);
            *acc = _mm256_fmadd_ps(wide, sums, *acc);
        }
    }
    acc.map(|v| hsum(v))
}

/// Outputs o..o + W of rows r..r + X.
#[inline(always)]
unsafe fn tile<const W: usize, const X: usize>(
    x: &QuantizedBlocks,
    w: &Q4Weights<'_>,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let (k, groups) = (w.fan_in, w.fan_in >> w.group.trailing_zeros());
    let weights: [*const u8; W] = std::array::from_fn(|a| w.packed.as_ptr().add((o + a) * k / 2));
    let next = w.packed.as_ptr().wrapping_add((o + W) * k / 2); // the next tile's rows follow
    let inputs: [*const i16; X] = std::array::from_fn(|b| x.values.as_ptr().add((r + b) * x.pairs * PAIR));
    let x_scales: [*const f32; X] =
        std::array::from_fn(|b| x.scales.as_ptr().add((r + b) * x.pairs * PAIR_SCALES));
    let mut acc = [[_mm256_setzero_ps(); X]; W];
    let mut scales8 = [_mm256_setzero_ps(); W]; // the tile's outputs' scales of eight groups
    let run = 8 * w.group / PAIR; // pairs of a run of eight groups (a power of two)
    let shift = (w.group / PAIR).max(1).trailing_zeros(); // pairs a group holds, log2 (for groups of 64+)
    for t in 0..x.pairs {
        let half = (t + 1) * PAIR > k;
        if r == 0 && t % PREFETCH_EVERY == 0 {
            for a in 0..W {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(a * k / 2 + t * PAIR / 2) as *const i8);
            }
        }
        let u = t & (run - 1);
        if u == 0 {
            for (a, s) in scales8.iter_mut().enumerate() {
                *s = eight_scales(w, groups, o + a, (t >> run.trailing_zeros()) * 8);
            }
        }
        let lanes = pair_lanes(w.group, u, shift);
        for (a, sums) in acc.iter_mut().enumerate() {
            let q = widen(weights[a].add(t * PAIR / 2), half);
            let scales = _mm256_permutevar8x32_ps(scales8[a], lanes);
            for (b, s) in sums.iter_mut().enumerate() {
                let xs = inputs[b].add(t * PAIR) as *const __m256i;
                let products = pair_products(&q, xs);
                let x_scale = _mm256_loadu_ps(x_scales[b].add(t * PAIR_SCALES));
                *s = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(products), x_scale), scales, *s);
            }
        }
    }
    for (a, sums) in acc.iter().enumerate() {
        let offsets = offsets_terms::<X>(w, x, groups, o + a, r);
        for (b, s) in sums.iter().enumerate() {
            y.set((r + b) * w.fan_out + o + a, w.output(o + a, hsum(*s), offsets[b]));
        }
    }
}

/// A pair of blocks' four nibble vectors times x's four runs of sixteen int16 at `xs`, as eight
/// exact i32 lanes (block 2t's four, then block 2t + 1's). Safety: AVX2; 128 bytes readable at `xs`.
#[inline(always)]
pub(crate) unsafe fn pair_products(q: &[__m256i; 4], xs: *const __m256i) -> __m256i {
    _mm256_add_epi32(
        _mm256_add_epi32(
            _mm256_madd_epi16(q[0], _mm256_loadu_si256(xs)),
            _mm256_madd_epi16(q[1], _mm256_loadu_si256(xs.add(1))),
        ),
        _mm256_add_epi32(
            _mm256_madd_epi16(q[2], _mm256_loadu_si256(xs.add(2))),
            _mm256_madd_epi16(q[3], _mm256_loadu_si256(xs.add(3))),
        ),
    )
}
