//! `linear_kquant`'s Q4_K rows with AVX-512 VNNI: `vpdpbusd` multiplies 64 nibbles with 64 int8
//! inputs and sums each four into an i32 lane, one instruction where AVX2 takes `vpmaddubsw` and
//! `vpmaddwd` on each half. On several rows the multiplies are what a step costs: on the AMD EPYC
//! here (Zen 4), Qwen2.5-Coder-1.5B's Q4_K layers at 5 rows and 2 threads took 46-47 ms this way
//! against 58-72 with the AVX2 half (~10 cycles a row and super-block, one thread, in cache).
//! Q6_K keeps the AVX2 half: its groups of 16 need a scale step for every two vectors, which
//! costs what `vpdpbusd` saves (tried: the same time at 1 and 5 rows).
//!
//! A sub-block's scale must reach each lane once its sums are in, so the lanes of the vectors
//! summed before it must all hold one sub-block. A super-block's 128 bytes of nibbles are four
//! 32-byte chunks (chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high); `vshufi64x2`
//! puts the first 16 bytes of each chunk in one vector (T0) and the last 16 in another (T1), so
//! that 128-bit lane c of both is chunk c: T0's and T1's low nibbles sum into `even` (lane group
//! c: sub-block 2c), their high nibbles into `odd` (2c + 1). x is reordered to match once a call
//! (`Int8Rows::q4k_lanes`). `vpackssdw` of even and odd puts each 128-bit lane's four even and
//! four odd sums side by side as i16 (|.| <= 2 * 4 * 15 * 127 < 2^15) and `vpmaddwd` multiplies
//! them with their sub-blocks' scales into sixteen i32 (|.| < 2^21, exact in f32). The minimums'
//! term is m against the sub-blocks' x sums, as in the AVX2 half.
//!
//! Every output is summed in one fixed order (super-blocks in turn, sixteen lanes, then
//! `_mm512_reduce_add_ps`'s order) whatever the rows beside it or the tile: a row gets the same
//! bits alone or in a batch. The bits differ from the AVX2 half's (its lanes sum other terms).
//!
//! Safety: every function here needs AVX-512 F, BW, VL and VNNI, F16C, and the shapes and kind
//! `linear_kquant` checked.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::linear::{for_row_tiles, SharedOutputs};
use crate::linear_kquant::{Int8Rows, KQuantWeights, SUPER};
use crate::linear_kquant_avx2::{hsum4, q4k_scales_and_mins, PREFETCH_AHEAD};

/// Bytes of a Q4_K super-block: d, dmin (f16), 12 bytes of 6-bit scales and minimums, 128 of nibbles.
const BYTES: usize = 144;
/// Input rows a tile takes (one weight row, whatever the rows): a verification step's rows (a
/// request and up to seven drafts) in one pass over the weights, in 32 registers.
const TILE_ROWS: usize = 8;

/// Whether the CPU runs this half.
pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// `linear_kquant::run_outputs` for Q4_K. `x.lanes` holds x in `Int8Rows::q4k_lanes`' order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn run_outputs(x: &Int8Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    for_row_tiles!(outputs, x.rows, TILE_ROWS, |o, r| tile::<N>(x, w, o, r, y));
}

/// A super-block's nibbles as `vpdpbusd` takes them, its scales as `vpmaddwd` takes them, its
/// minimums and its [d, dmin]: the part of the work each weight row does once for all rows.
struct Unpacked {
    low: [__m512i; 2],
    high: [__m512i; 2],
    scales: __m512i,
    mins: __m128i,
    d: __m128,
}

#[inline(always)]
unsafe fn unpack(p: *const u8) -> Unpacked {
    let q0 = _mm512_loadu_si512(p.add(16) as *const __m512i);
    let q1 = _mm512_loadu_si512(p.add(80) as *const __m512i);
    // 128-bit lane c: chunk c's first 16 bytes (t0) and its last 16 (t1)
    let t0 = _mm512_shuffle_i64x2::<0b10_00_10_00>(q0, q1);
    let t1 = _mm512_shuffle_i64x2::<0b11_01_11_01>(q0, q1);
    let nibble = _mm512_set1_epi8(0x0F);
    let low = [_mm512_and_si512(t0, nibble), _mm512_and_si512(t1, nibble)];
    let high = [
        _mm512_and_si512(_mm512_srli_epi16::<4>(t0), nibble),
        _mm512_and_si512(_mm512_srli_epi16::<4>(t1), nibble),
    ];
    let both = q4k_scales_and_mins(p); // i16: sc0..sc7, m0..m7
    Unpacked {
        low,
        high,
        scales: _mm512_permutexvar_epi16(
            _mm512_loadu_si512(SCALE_WORDS.as_ptr() as *const __m512i),
            _mm512_castsi256_si512(both),
        ),
        mins: _mm256_extracti128_si256::<1>(both),
        d: _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned())),
    }
}

/// `vpermw` indices: 128-bit lane c's words are sc[2c] four times, then sc[2c + 1] four times.
static SCALE_WORDS: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        idx[i] = (2 * (i / 8) + (i % 8) / 4) as u16;
        i += 1;
    }
    idx
};

/// A tile's running sums for one row: the scaled products (`main`) and the minimums' term
/// (`mins`, taken off at the end).
#[derive(Clone, Copy)]
struct Sums {
    main: __m512,
    mins: __m128,
}

/// Output o of rows r..r + X.
#[inline(always)]
unsafe fn tile<const X: usize>(x: &Int8Rows, w: &KQuantWeights<'_>, o: usize, r: usize, y: &SharedOutputs) {
    let k = w.fan_in;
    let weights = w.row(o).as_ptr();
    let lanes: [*const i8; X] = std::array::from_fn(|b| x.lanes.as_ptr().add((r + b) * k));
    let scales: [*const f32; X] = std::array::from_fn(|b| x.scales.as_ptr().add((r + b) * k / SUPER));
    let sums32: [*const i16; X] = std::array::from_fn(|b| x.sums32.as_ptr().add((r + b) * k / 32));
    let mut acc = [Sums { main: _mm512_setzero_ps(), mins: _mm_setzero_ps() }; X];
    for s in 0..k / SUPER {
        if r == 0 {
            // the bytes PREFETCH_AHEAD past this super-block (the next rows follow this one)
            let ahead = weights.wrapping_add(s * BYTES + PREFETCH_AHEAD);
            for line in [0, 64, BYTES - 1] {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
            }
        }
        let u = unpack(weights.add(s * BYTES));
        for (b, sums) in acc.iter_mut().enumerate() {
            let xs = lanes[b].add(s * SUPER) as *const __m512i;
            let zero = _mm512_setzero_si512();
            let even = _mm512_dpbusd_epi32(zero, u.low[0], _mm512_loadu_si512(xs));
            let even = _mm512_dpbusd_epi32(even, u.low[1], _mm512_loadu_si512(xs.add(1)));
            let odd = _mm512_dpbusd_epi32(zero, u.high[0], _mm512_loadu_si512(xs.add(2)));
            let odd = _mm512_dpbusd_epi32(odd, u.high[1], _mm512_loadu_si512(xs.add(3)));
            let scaled = _mm512_madd_epi16(_mm512_packs_epi32(even, odd), u.scales);
            let dx = _mm_mul_ps(u.d, _mm_broadcast_ss(&*scales[b].add(s))); // [d, dmin] times the x scale
            sums.main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled), _mm512_broadcastss_ps(dx), sums.main);
            let m = _mm_madd_epi16(u.mins, _mm_loadu_si128(sums32[b].add(s * 8) as *const __m128i));
            sums.mins = _mm_fmadd_ps(_mm_cvtepi32_ps(m), _mm_permute_ps::<0b01_01_01_01>(dx), sums.mins);
        }
    }
    for (b, s) in acc.iter().enumerate() {
        let total = _mm512_reduce_add_ps(s.main) - hsum4(s.mins);
        y.set((r + b) * w.fan_out + o, w.output(o, total));
    }
}
