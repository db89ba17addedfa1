//! The AVX2 half of `linear_kquant` for Q5_0 (22 bytes a block of 32 weights: d as f16, qh as a
//! u32, qs[16]), x quantized to int8 per 32 inputs (`Int8Rows` in blocks of 32, llama.cpp's Q8_0
//! activations for this type). A block's weights are unpacked once into 32 signed bytes q - 16
//! (weight j < 16 the low nibble of qs[j], weight j + 16 its high one, bit j of qh their 16s) and
//! multiplied with every row of the tile: `vpsignb` moves the sign of q - 16 onto x (`vpmaddubsw`
//! takes one operand unsigned), `vpmaddubsw` sums pairs in i16 (|.| <= 2 * 16 * 127), `vpmaddwd`
//! with ones sums those in i32, and the eight lanes, in f32, times d and the block's x scale, are
//! added into the output's eight running sums.
//!
//! Each output is summed in one fixed order (its blocks in turn, lane by lane, then `hsum`'s
//! order) whatever the rows beside it or the tile: a row gets the same bits alone or in a batch.
//!
//! Safety: every function here needs a CPU with AVX2, FMA and F16C, and the shapes and kind
//! `linear_kquant` checked.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::SharedOutputs;
use crate::linear_kquant::{Int8Rows, KQuantWeights};
use crate::vector::avx2::hsum;

/// Weights of a block, and its bytes.
const BLOCK: usize = 32;
const BYTES: usize = 22;
/// Input rows of a tile, whose weights are always one weight row: on the AMD EPYC here (one
/// thread, 896 x 77824) a row of x took 3.9 ms with each weight row streamed alone, 9.1 ms two at
/// a time and 12.7 ms four at a time (rows of 22-byte blocks read side by side).
const TILE_ROWS: usize = 4;

/// `linear_kquant::run_outputs` for Q5_0 with AVX2, FMA and F16C (and AVX-512BW's byte masks
/// for qh where the CPU has them: the same bytes, so the same bits).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn run_outputs(x: &Int8Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    if crate::vector::avx512bw_available() {
        return run_outputs_masked(x, w, outputs, y);
    }
    run::<false>(x, w, outputs, y)
}

/// `run_outputs` with qh's bits turned into bytes by a mask (`vmovdqu8`): 2.0 ms against 2.7 for
/// a row of x on 896 x 77824 (two threads). Safety: also AVX-512F, VL and BW.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn run_outputs_masked(x: &Int8Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    run::<true>(x, w, outputs, y)
}

#[inline(always)]
unsafe fn run<const MASK: bool>(
    x: &Int8Rows,
    w: &KQuantWeights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    for o in outputs {
        let mut r = 0;
        while r < x.rows {
            match x.rows - r {
                1 => tile::<MASK, 1>(x, w, o, r, y),
                2 => tile::<MASK, 2>(x, w, o, r, y),
                3 => tile::<MASK, 3>(x, w, o, r, y),
                _ => tile::<MASK, TILE_ROWS>(x, w, o, r, y),
            }
            r += TILE_ROWS;
        }
    }
}

/// The block at `p`'s weights minus 16, as 32 signed bytes in order (qh's bits made bytes by a
/// mask where MASK, else by a shuffle and a compare).
#[inline(always)]
unsafe fn unpack<const MASK: bool>(p: *const u8) -> __m256i {
    let qs = _mm_loadu_si128(p.add(6) as *const __m128i);
    let low4 = _mm_set1_epi8(0x0F);
    let nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(qs), low4), _mm_and_si128(qs, low4));
    if MASK {
        let sixteens =
            _mm256_maskz_mov_epi8((p.add(2) as *const u32).read_unaligned(), _mm256_set1_epi8(0x10));
        return _mm256_sub_epi8(_mm256_or_si256(nibbles, sixteens), _mm256_set1_epi8(16));
    }
    // byte j takes qh's byte j / 8 (each 128-bit lane holds all of qh), then tests its own bit
    let qh = _mm256_set1_epi32((p.add(2) as *const i32).read_unaligned());
    let spread = _mm256_shuffle_epi8(
        qh,
        _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let sixteens =
        _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
    _mm256_sub_epi8(_mm256_or_si256(nibbles, sixteens), _mm256_set1_epi8(16))
}

/// Output o of rows r..r + X.
#[inline(always)]
unsafe fn tile<const MASK: bool, const X: usize>(
    x: &Int8Rows,
    w: &KQuantWeights<'_>,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let k = w.fan_in;
    let blocks = k / BLOCK;
    let ones = _mm256_set1_epi16(1);
    let weights = w.row(o).as_ptr();
    let inputs: [*const i8; X] = std::array::from_fn(|c| x.values.as_ptr().add((r + c) * k));
    let x_scales: [*const f32; X] = std::array::from_fn(|c| x.scales.as_ptr().add((r + c) * blocks));
    let mut acc = [_mm256_setzero_ps(); X];
    for b in 0..blocks {
        let p = weights.add(b * BYTES);
        let q = unpack::<MASK>(p);
        let magnitude = _mm256_sign_epi8(q, q);
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)));
        for (c, s) in acc.iter_mut().enumerate() {
            let xs = _mm256_loadu_si256(inputs[c].add(b * BLOCK) as *const __m256i);
            let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xs, q)), ones);
            let scale = _mm256_set1_ps(d * *x_scales[c].add(b));
            *s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *s);
        }
    }
    for (c, s) in acc.iter().enumerate() {
        y.set((r + c) * w.fan_out + o, w.output(o, hsum(*s)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways of unpacking give the same bytes (the kernel's tests run whichever the CPU takes).
    #[test]
    fn the_shuffle_and_the_mask_unpack_the_same_bytes() {
        if !(crate::vector::avx2_fma_available() && crate::vector::avx512bw_available()) {
            return; // one way only on this CPU
        }
        // SAFETY: the CPU has AVX2, FMA, F16C (with AVX2 on every x86 CPU that has AVX-512) and AVX-512BW.
        unsafe { compare() }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
    unsafe fn compare() {
        let mut state = 0x9e37_79b9u32;
        for _ in 0..256 {
            let block: [u8; BYTES] = std::array::from_fn(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 24) as u8
            });
            let (mut shuffled, mut masked) = ([0u8; 32], [0u8; 32]);
            _mm256_storeu_si256(shuffled.as_mut_ptr() as *mut __m256i, unpack::<false>(block.as_ptr()));
            _mm256_storeu_si256(masked.as_mut_ptr() as *mut __m256i, unpack::<true>(block.as_ptr()));
            assert_eq!(shuffled, masked, "{block:?}");
        }
    }
}
