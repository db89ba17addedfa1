//! The AVX2 half of `linear_kquant`, a super-block (256 weights) of a weight row a step, its
//! bytes unpacked once and multiplied with every row of the tile, all in i32 until the
//! super-block's end:
//! - Q4_K: each 32-byte chunk (64 weights: sub-block 2j in the low nibbles, 2j + 1 in the high)
//!   gives two vectors of 32 nibbles by a mask and a shift; `vpmaddubsw` multiplies each with 32
//!   int8 inputs (pairs summed in i16, |.| <= 3810), `vpmaddwd` with the sub-block's scale sc
//!   (sixteen i16 lanes of it) sums pairs again into i32. The minimums' term is m against the
//!   x sums of the sub-blocks (`Int8Rows::sums32`).
//! - Q6_K: a half (128 weights) is three 32-byte loads (ql's two runs, qh); byte masks and shifts
//!   give four runs of 32 6-bit q; `vpmaddubsw` with the inputs (|.| <= 16002), `vpmaddwd` with
//!   the run's two group scales (eight lanes each); the -32 offset is 32 sc . sums16.
//!
//! An i32 lane's sum over a super-block stays under 2^26.
//!
//! A tile is one weight row against up to eight input rows, so each thread reads the weights as
//! one sequential stream: a single input row's tile asks for the lines `PREFETCH_AHEAD` ahead, a
//! tile of several rows for the next weight row, a share of it each super-block. Several weight
//! rows read side by side stream slower here: four a tile streamed Q6_K at ~20 GB/s with each
//! row's own next blocks prefetched, ~30 with the next four prefetched as one run, and one row at
//! a time is faster still (`PREFETCH_AHEAD`). Each output is summed in one fixed order
//! (super-blocks and parts in turn, lane by lane, then `hsum`'s order) whatever the rows beside
//! it or the tile.
//!
//! Safety: every function here needs a CPU with AVX2, FMA and F16C, and the shapes and kind
//! `linear_kquant` checked.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::gguf_blocks::BlockKind;
use crate::linear::SharedOutputs;
use crate::linear_kquant::{Int8Rows, KQuantWeights, SUPER};
use crate::vector::avx2::hsum;

/// How far ahead of the super-block it multiplies a tile asks for the weights' lines (a single
/// row's tile here; every tile of `linear_q4k_vnni`). Measured on the AMD EPYC here with
/// Qwen2.5-Coder-1.5B's batch-1 decode (one process, the ways alternated 6-8 times): this half
/// one weight row at a time with the lines 4 KiB ahead, against four rows at a time with the next
/// four prefetched, 6.6% faster with its Q6_K layers and 9.2% with its Q4_K ones too (VNNI turned
/// off to measure it); the VNNI half 4 KiB ahead against one row ahead (864 bytes at a fan_in of
/// 1536, too close for memory's latency) 6.6% faster (8 KiB the same; its layers' kernel time 4%
/// less at 4 KiB, 1.5% at 16 KiB, 3.6% more at 32 KiB; at five rows the same time).
pub(crate) const PREFETCH_AHEAD: usize = 4096;
/// Input rows of a tile at several input rows (one weight row), with AVX2's 16 registers.
const MULTI_ROW_ROWS: usize = 5;
/// The same where AVX-512VL gives these 8-lane instructions 32 registers: a verification step's
/// rows (a request and up to seven drafts) in one pass over the weights. On the AMD EPYC here
/// (one thread, 1536 x 71680 Q4_K), five rows took 9.0 ms this way against 11.9 with 16
/// registers, eight 14 against 19.7.
const WIDE_MULTI_ROW_ROWS: usize = 8;

/// `linear_kquant::run_outputs` with AVX2, FMA and F16C (and for several rows the 32 registers
/// of AVX-512VL where the CPU has them: the same instructions, so the same bits).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn run_outputs(x: &Int8Rows, w: &KQuantWeights<'_>, outputs: Range<usize>, y: &SharedOutputs) {
    if x.rows > 1 && crate::vector::avx512vl_available() {
        return run_outputs_32_registers(x, w, outputs, y);
    }
    match w.kind {
        BlockKind::Q4K => run::<Q4K, MULTI_ROW_ROWS>(x, w, outputs, y),
        _ => run::<Q6K, MULTI_ROW_ROWS>(x, w, outputs, y),
    }
}

/// `run_outputs` with 32 vector registers. Safety: also AVX-512F and AVX-512VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn run_outputs_32_registers(
    x: &Int8Rows,
    w: &KQuantWeights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    match w.kind {
        BlockKind::Q4K => run::<Q4K, WIDE_MULTI_ROW_ROWS>(x, w, outputs, y),
        _ => run::<Q6K, WIDE_MULTI_ROW_ROWS>(x, w, outputs, y),
    }
}

#[inline(always)]
unsafe fn run<K: SuperBlock, const ROWS: usize>(
    x: &Int8Rows,
    w: &KQuantWeights<'_>,
    outputs: Range<usize>,
    y: &SharedOutputs,
) {
    for o in outputs {
        let mut r = 0;
        while r < x.rows {
            match x.rows - r {
                1 => tile::<K, 1>(x, w, o, r, y),
                2 => tile::<K, 2>(x, w, o, r, y),
                3 => tile::<K, 3>(x, w, o, r, y),
                4 => tile::<K, 4>(x, w, o, r, y),
                5 if ROWS > 5 => tile::<K, 5>(x, w, o, r, y),
                6 if ROWS > 6 => tile::<K, 6>(x, w, o, r, y),
                7 if ROWS > 7 => tile::<K, 7>(x, w, o, r, y),
                _ => tile::<K, ROWS>(x, w, o, r, y),
            }
            r += ROWS;
        }
    }
}

/// `linear_kquant::quantize` eight lanes at a time, the same arithmetic (so the same bits: IEEE
/// division, the same rounding, NaN as 0).
/// Safety: AVX2; `block` a whole number of 32 values, `out` as long, `sums16` a 16th of it.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize(block: &[f32], out: &mut [i8], sums16: &mut [i16]) -> f32 {
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut largest = _mm256_setzero_ps();
    for run in block.chunks_exact(8) {
        // `vmaxps` answers its second operand where either is NaN: NaN inputs are passed over
        largest = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(run.as_ptr()), magnitude), largest);
    }
    let lanes: [f32; 8] = std::mem::transmute(largest);
    let scale = lanes.into_iter().fold(0.0f32, f32::max).max(f32::MIN_POSITIVE) / 127.0;
    let (divisor, shift, limit) =
        (_mm256_set1_ps(scale), _mm256_set1_ps(12_582_912.0), _mm256_set1_ps(127.0));
    let (bias, zero) = (_mm256_set1_epi8(-128), _mm256_setzero_si256());
    for ((run, q), sums) in
        block.chunks_exact(32).zip(out.chunks_exact_mut(32)).zip(sums16.chunks_exact_mut(2))
    {
        let p = run.as_ptr();
        let ints = [
            quantize8(p, divisor, shift, limit),
            quantize8(p.add(8), divisor, shift, limit),
            quantize8(p.add(16), divisor, shift, limit),
            quantize8(p.add(24), divisor, shift, limit),
        ];
        // packs work within 128-bit lanes: [0-3, 8-11, 4-7, 12-15] and so on, put back in order
        let low = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(ints[0], ints[1]));
        let high = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(ints[2], ints[3]));
        let bytes = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi16(low, high));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
        // each run of 8 bytes summed (`vpsadbw`) as v + 128, in four u64 lanes
        let eights: [i64; 4] = std::mem::transmute(_mm256_sad_epu8(_mm256_xor_si256(bytes, bias), zero));
        sums[0] = (eights[0] + eights[1] - 2048) as i16;
        sums[1] = (eights[2] + eights[3] - 2048) as i16;
    }
    scale
}

/// Eight values at `p` divided by the block's scale, rounded half to even, clamped to +-127, as
/// i32 (NaN as 0). A function, not a closure: closures do not take the caller's target features.
#[inline(always)]
unsafe fn quantize8(p: *const f32, divisor: __m256, shift: __m256, limit: __m256) -> __m256i {
    let v = _mm256_div_ps(_mm256_loadu_ps(p), divisor);
    let rounded = _mm256_sub_ps(_mm256_add_ps(v, shift), shift);
    let clamped = _mm256_min_ps(_mm256_max_ps(rounded, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit);
    let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
    _mm256_and_si256(_mm256_cvttps_epi32(clamped), ordered)
}

/// A tile's rows of x, each at its row's start.
struct Rows<const X: usize> {
    values: [*const i8; X],
    scales: [*const f32; X],
    sums16: [*const i16; X],
    sums32: [*const i16; X],
}

/// A super-block's scales as i16 lanes, shared by its parts: [sc0..sc7 | sc0..sc7] for Q4_K,
/// [sc0..sc7 | sc0..sc7] and [sc8..sc15 | sc8..sc15] for Q6_K.
type Scales = [__m256i; 2];

/// A tile's running sums for each of its rows: the scaled products (`main`) and Q4_K's
/// minimums' term (`mins`, taken off at the end).
#[derive(Clone, Copy)]
struct Sums {
    main: __m256,
    mins: __m128,
}

/// One K-quant type's super-block against the rows of a tile, in parts (so that a tile's
/// outputs take turns part by part: their integer sums are independent chains, kept in
/// registers), then scaled into each row's f32 sums.
trait SuperBlock {
    const BYTES: usize;
    const PARTS: usize;
    /// The super-block at `p`'s scales; Q6_K's -32 offsets' term goes into the integer sums.
    unsafe fn scales<const X: usize>(p: *const u8, x: &Rows<X>, s: usize, sums: &mut [__m256i; X]) -> Scales;
    /// Adds part `part`'s products with super-block `s` of each row into `sums`.
    unsafe fn add<const X: usize>(
        p: *const u8,
        part: usize,
        scales: &Scales,
        x: &Rows<X>,
        s: usize,
        sums: &mut [__m256i; X],
    );
    /// Adds the super-block's integer sums, times its d and each row's x scale, into `acc`.
    unsafe fn finish<const X: usize>(
        p: *const u8,
        scales: &Scales,
        x: &Rows<X>,
        s: usize,
        sums: &[__m256i; X],
        acc: &mut [Sums; X],
    );
}

/// Two f16 at `p` as lanes 0 and 1.
#[inline(always)]
unsafe fn two_f16(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
}

/// `vpshufb` masks: word i of each 128-bit lane in all eight of its words (i = 0..8).
static WORD: [[u8; 32]; 8] = {
    let mut masks = [[0u8; 32]; 8];
    let mut i = 0;
    while i < 8 {
        let mut b = 0;
        while b < 32 {
            masks[i][b] = (2 * i + b % 2) as u8;
            b += 1;
        }
        i += 1;
    }
    masks
};

/// `vpshufb` masks: word 2i of the low lane in its eight words, word 2i + 1 of the high lane in
/// its eight (i = 0..4): a Q6_K run's two group scales.
static WORD_PAIR: [[u8; 32]; 4] = {
    let mut masks = [[0u8; 32]; 4];
    let mut i = 0;
    while i < 4 {
        let mut b = 0;
        while b < 32 {
            masks[i][b] = (2 * (2 * i + b / 16) + b % 2) as u8;
            b += 1;
        }
        i += 1;
    }
    masks
};

#[inline(always)]
unsafe fn shuffle(v: __m256i, mask: &[u8; 32]) -> __m256i {
    _mm256_shuffle_epi8(v, _mm256_loadu_si256(mask.as_ptr() as *const __m256i))
}

/// A Q4_K super-block's 12 bytes of 6-bit scales and minimums (`gguf_blocks`' layout) as sixteen
/// i16: sc0..sc7, m0..m7.
#[inline(always)]
pub(crate) unsafe fn q4k_scales_and_mins(p: *const u8) -> __m256i {
    // as four u32 of bytes [sc0..3, sc4..7, m0..3, m4..7]: from u = [u0, u1, u2, -], sc0..3 =
    // u0 & 0x3f.., sc4..7 = (u2 & 0x0f..) | ((u0 >> 6) & 0x03..) << 4, m0..3 = u1 & 0x3f..,
    // m4..7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 6) & 0x03..) << 4
    let u = _mm_loadu_si128(p.add(4) as *const __m128i); // 4 bytes past them: the first qs
    let lows = _mm_shuffle_epi32::<0b10_01_10_00>(u); // [u0, u2, u1, u2]
    let highs = _mm_shuffle_epi32::<0b01_01_00_00>(u); // [u0, u0, u1, u1]
    let lows = _mm_and_si128(
        _mm_srlv_epi32(lows, _mm_set_epi32(4, 0, 0, 0)),
        _mm_set_epi32(0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f),
    );
    let highs = _mm_and_si128(_mm_srli_epi32::<2>(highs), _mm_set_epi32(0x3030_3030, 0, 0x3030_3030, 0));
    _mm256_cvtepu8_epi16(_mm_or_si128(lows, highs))
}

struct Q4K;

impl SuperBlock for Q4K {
    const BYTES: usize = 144;
    const PARTS: usize = 4; // chunks of 64 weights: sub-blocks 2j (low nibbles) and 2j + 1

    #[inline(always)]
    unsafe fn scales<const X: usize>(p: *const u8, _: &Rows<X>, _: usize, _: &mut [__m256i; X]) -> Scales {
        let both = q4k_scales_and_mins(p);
        [_mm256_permute2x128_si256::<0x00>(both, both), _mm256_permute2x128_si256::<0x11>(both, both)]
    }

    #[inline(always)]
    unsafe fn add<const X: usize>(
        p: *const u8,
        j: usize,
        scales: &Scales,
        x: &Rows<X>,
        s: usize,
        sums: &mut [__m256i; X],
    ) {
        let v = _mm256_loadu_si256(p.add(16 + 32 * j) as *const __m256i);
        let nibble = _mm256_set1_epi8(0x0F);
        let low = _mm256_and_si256(v, nibble);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
        let (sc_low, sc_high) = (shuffle(scales[0], &WORD[2 * j]), shuffle(scales[0], &WORD[2 * j + 1]));
        for (b, sum) in sums.iter_mut().enumerate() {
            let xs = x.values[b].add(s * SUPER + 64 * j) as *const __m256i;
            let a = _mm256_madd_epi16(_mm256_maddubs_epi16(low, _mm256_loadu_si256(xs)), sc_low);
            let c = _mm256_madd_epi16(_mm256_maddubs_epi16(high, _mm256_loadu_si256(xs.add(1))), sc_high);
            *sum = _mm256_add_epi32(*sum, _mm256_add_epi32(a, c));
        }
    }

    #[inline(always)]
    unsafe fn finish<const X: usize>(
        p: *const u8,
        scales: &Scales,
        x: &Rows<X>,
        s: usize,
        sums: &[__m256i; X],
        acc: &mut [Sums; X],
    ) {
        let d = two_f16(p); // [d, dmin]
        let mins = _mm256_castsi256_si128(scales[1]); // m0..m7
        for (b, acc) in acc.iter_mut().enumerate() {
            let dx = _mm_mul_ps(d, _mm_broadcast_ss(&*x.scales[b].add(s))); // [d, dmin] times the x scale
            acc.main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[b]), _mm256_broadcastss_ps(dx), acc.main);
            let m = _mm_madd_epi16(mins, _mm_loadu_si128(x.sums32[b].add(s * 8) as *const __m128i));
            acc.mins = _mm_fmadd_ps(_mm_cvtepi32_ps(m), _mm_permute_ps::<0b01_01_01_01>(dx), acc.mins);
        }
    }
}

struct Q6K;

impl SuperBlock for Q6K {
    const BYTES: usize = 210;
    const PARTS: usize = 2; // halves of 128 weights

    #[inline(always)]
    unsafe fn scales<const X: usize>(p: *const u8, x: &Rows<X>, s: usize, sums: &mut [__m256i; X]) -> Scales {
        let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i)); // sc0..sc15
        for (b, sum) in sums.iter_mut().enumerate() {
            let x16 = _mm256_loadu_si256(x.sums16[b].add(s * 16) as *const __m256i);
            *sum = _mm256_sub_epi32(*sum, _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc, x16)));
        }
        [_mm256_permute2x128_si256::<0x00>(sc, sc), _mm256_permute2x128_si256::<0x11>(sc, sc)]
    }

    #[inline(always)]
    unsafe fn add<const X: usize>(
        p: *const u8,
        h: usize,
        scales: &Scales,
        x: &Rows<X>,
        s: usize,
        sums: &mut [__m256i; X],
    ) {
        let (low4, bits45) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        let ql0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
        let ql1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
        let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
        // run t of the half (32 weights): ql's low (t = 0, 1) or high (2, 3) nibbles, qh's bits
        // 2t, 2t + 1 as bits 4 and 5 (16-bit shifts: what crosses a byte is masked off)
        let q = [
            _mm256_or_si256(
                _mm256_and_si256(ql0, low4),
                _mm256_and_si256(_mm256_slli_epi16::<4>(qh), bits45),
            ),
            _mm256_or_si256(
                _mm256_and_si256(ql1, low4),
                _mm256_and_si256(_mm256_slli_epi16::<2>(qh), bits45),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                _mm256_and_si256(qh, bits45),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), bits45),
            ),
        ];
        for (t, q) in q.into_iter().enumerate() {
            let run = 4 * h + t; // of eight in the super-block: groups 2 run and 2 run + 1
            let sc = shuffle(scales[h], &WORD_PAIR[t]);
            for (b, sum) in sums.iter_mut().enumerate() {
                let xs = _mm256_loadu_si256(x.values[b].add(s * SUPER + 32 * run) as *const __m256i);
                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q, xs), sc));
            }
        }
    }

    #[inline(always)]
    unsafe fn finish<const X: usize>(
        p: *const u8,
        _: &Scales,
        x: &Rows<X>,
        s: usize,
        sums: &[__m256i; X],
        acc: &mut [Sums; X],
    ) {
        let d = _mm_cvtss_f32(two_f16(p.add(208)));
        for (b, acc) in acc.iter_mut().enumerate() {
            let dx = _mm256_set1_ps(d * *x.scales[b].add(s));
            acc.main = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[b]), dx, acc.main);
        }
    }
}

/// Output o of rows r..r + X.
#[inline(always)]
unsafe fn tile<K: SuperBlock, const X: usize>(
    x: &Int8Rows,
    w: &KQuantWeights<'_>,
    o: usize,
    r: usize,
    y: &SharedOutputs,
) {
    let (k, row_bytes) = (w.fan_in, w.row_bytes());
    let weights = w.row(o).as_ptr();
    let mut rows = Rows::<X> {
        values: [std::ptr::null(); X],
        scales: [std::ptr::null(); X],
        sums16: [std::ptr::null(); X],
        sums32: [std::ptr::null(); X],
    };
    for b in 0..X {
        rows.values[b] = x.values.as_ptr().add((r + b) * k);
        rows.scales[b] = x.scales.as_ptr().add((r + b) * k / SUPER);
        rows.sums16[b] = x.sums16.as_ptr().add((r + b) * k / 16);
        rows.sums32[b] = x.sums32.as_ptr().add((r + b) * k / 32);
    }
    let mut acc = [Sums { main: _mm256_setzero_ps(), mins: _mm_setzero_ps() }; X];
    for s in 0..k / SUPER {
        let block = weights.add(s * K::BYTES);
        if x.rows == 1 {
            let ahead = block.wrapping_add(PREFETCH_AHEAD);
            let mut line = 0;
            while line < K::BYTES {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
                line += 64;
            }
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(K::BYTES - 1) as *const i8);
        } else if r == 0 {
            // the next row, a share of its lines each super-block (no division in the loop)
            let next = weights.wrapping_add(row_bytes);
            let mut line = (s * K::BYTES) & !63;
            while line < (s + 1) * K::BYTES {
                _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line) as *const i8);
                line += 64;
            }
        }
        let mut sums = [_mm256_setzero_si256(); X];
        let scales = K::scales::<X>(block, &rows, s, &mut sums);
        for part in 0..K::PARTS {
            K::add::<X>(block, part, &scales, &rows, s, &mut sums);
        }
        K::finish::<X>(block, &scales, &rows, s, &sums, &mut acc);
    }
    for (b, s) in acc.iter().enumerate() {
        let total = hsum(s.main) - hsum4(s.mins);
        y.set((r + b) * w.fan_out + o, w.output(o, total));
    }
}

/// The sum of four lanes.
#[inline(always)]
pub(crate) unsafe fn hsum4(v: __m128) -> f32 {
    let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}
