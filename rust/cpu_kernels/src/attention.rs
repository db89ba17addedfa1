//! Paged decode attention for CPUs.
//!
//! One query token per sequence attends to the sequence's cached keys and values, read in place
//! from a paged cache through its block table: each cached row is read once, where a gather into
//! a padded dense tensor followed by a dense attention reads it twice and writes it once. On
//! CPUs, whose decode attention is bound by memory bandwidth, that is the whole cost (inside the
//! engine a step's rows are mostly out of cache: 256 sequences of 75 keys took ~1.2 ms there
//! against ~0.5 ms called again on warm rows, which is why spreading the sequences over threads
//! pays). AVX2 where the CPU has it.
//!
//! Layouts (row-major, f32): cache `[num_blocks, block_size, num_kv_heads, head_dim]` for keys
//! and values alike; queries and output `[num_seqs, num_q_heads, head_dim]`; block tables
//! `[num_seqs, table_width]`. Query head `h` reads kv head `h / (num_q_heads / num_kv_heads)`
//! (grouped-query attention). A sequence of length 0 gets zeros.
//!
//! The kernel: checks, then each sequence in two passes over its rows. `decode_attention` runs
//! on the calling thread; `decode_attention_on` splits the sequences into ranges of about equal
//! numbers of keys and runs them on the threads of a `ForkJoin` the caller lends. Not a pool of
//! its own: between torch ops, torch's OpenMP workers keep spinning on the other cores, and
//! threads competing with them made the kernel 2-3x slower inside the engine than alone
//! (measured on 2 cores with two rayon threads).

use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use crate::parallel::{ForkJoin, OnCallingThread, MIN_PARALLEL_WORK};
use crate::vector::{axpy, dot, has_avx2_fma, sum};

/// The paged KV cache of one layer.
pub struct PagedCache<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// One decode step's sequences.
pub struct DecodeBatch<'a> {
    pub queries: &'a [f32],
    pub num_q_heads: usize,
    pub block_tables: &'a [i32],
    pub table_width: usize,
    pub seq_lens: &'a [i32],
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AttentionError {
    #[error("{0}")]
    Shape(String),
    #[error("sequence {seq}: length {len} needs more than the {capacity} slots of its block table")]
    TooLong { seq: usize, len: i64, capacity: usize },
    #[error("sequence {seq}: block id {block} is outside the cache's {num_blocks} blocks")]
    BlockOutOfRange { seq: usize, block: i64, num_blocks: usize },
}

/// Writes softmax(q k^T * scale) v for every sequence's query heads into `out`.
pub fn decode_attention(
    cache: &PagedCache<'_>,
    batch: &DecodeBatch<'_>,
    scale: f32,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    decode_attention_on(&OnCallingThread, cache, batch, scale, out)
}

/// `decode_attention` with the sequences spread over the threads of `pool`: each thread takes
/// ranges of sequences (about four per thread, of about equal numbers of keys) and writes their
/// rows of `out`. The result is the same bits as on one thread.
pub fn decode_attention_on(
    pool: &dyn ForkJoin,
    cache: &PagedCache<'_>,
    batch: &DecodeBatch<'_>,
    scale: f32,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    check(cache, batch, out)?;
    let per_seq = batch.num_q_heads * cache.head_dim;
    let keys: usize = batch.seq_lens.iter().map(|&n| n as usize).sum();
    let parts = if keys * per_seq < MIN_PARALLEL_WORK { 1 } else { 4 * pool.threads() };
    let ranges = balanced_ranges(batch.seq_lens, parts);
    if ranges.len() <= 1 {
        sequences(cache, batch, scale, 0..batch.seq_lens.len(), out);
        return Ok(());
    }
    let mut rest = out;
    let mut outs = Vec::with_capacity(ranges.len());
    for r in &ranges {
        let (head, tail) = rest.split_at_mut(r.len() * per_seq);
        outs.push(Mutex::new(head));
        rest = tail;
    }
    pool.run(ranges.len(), &|i| {
        let mut out = outs[i].lock().unwrap_or_else(PoisonError::into_inner);
        sequences(cache, batch, scale, ranges[i].clone(), &mut out);
    });
    Ok(())
}

/// Sequences 0..lens.len() in at most `parts` contiguous, non-empty ranges of about equal total
/// length.
fn balanced_ranges(lens: &[i32], parts: usize) -> Vec<Range<usize>> {
    let total: usize = lens.iter().map(|&n| n as usize).sum();
    let mut ranges = Vec::with_capacity(parts);
    let (mut start, mut acc) = (0, 0);
    for (i, &n) in lens.iter().enumerate() {
        acc += n as usize;
        if ranges.len() + 1 < parts && acc * parts >= total * (ranges.len() + 1) {
            ranges.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < lens.len() {
        ranges.push(start..lens.len());
    }
    ranges
}

/// The sequences of `seqs`, in order, on the calling thread; `out` holds their rows only.
fn sequences(
    cache: &PagedCache<'_>,
    batch: &DecodeBatch<'_>,
    scale: f32,
    seqs: Range<usize>,
    out: &mut [f32],
) {
    let per_seq = batch.num_q_heads * cache.head_dim;
    let avx2 = has_avx2_fma();
    let mut scores = Vec::new();
    for (seq, out_seq) in seqs.zip(out.chunks_exact_mut(per_seq)) {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: has_avx2_fma found that the CPU supports AVX2 and FMA.
            unsafe { sequence_avx2(cache, batch, scale, seq, &mut scores, out_seq) };
            continue;
        }
        sequence::<false>(cache, batch, scale, seq, &mut scores, out_seq);
    }
}

fn check(cache: &PagedCache<'_>, batch: &DecodeBatch<'_>, out: &[f32]) -> Result<(), AttentionError> {
    let shape = |msg: String| Err(AttentionError::Shape(msg));
    let (bs, hkv, d, hq) = (cache.block_size, cache.num_kv_heads, cache.head_dim, batch.num_q_heads);
    if bs == 0 || hkv == 0 || d == 0 || hq == 0 {
        return shape("block_size, num_kv_heads, head_dim and num_q_heads must be positive".into());
    }
    if hq % hkv != 0 {
        return shape(format!("num_q_heads {hq} is not a multiple of num_kv_heads {hkv}"));
    }
    let row = bs * hkv * d;
    if cache.keys.len() % row != 0 || cache.values.len() != cache.keys.len() {
        return shape("keys and values must both be [num_blocks, block_size, num_kv_heads, head_dim]".into());
    }
    let num_seqs = batch.seq_lens.len();
    if batch.queries.len() != num_seqs * hq * d || out.len() != batch.queries.len() {
        return shape(format!("queries and out must be [{num_seqs}, {hq}, {d}]"));
    }
    if batch.block_tables.len() != num_seqs * batch.table_width {
        return shape(format!("block_tables must be [{num_seqs}, {}]", batch.table_width));
    }
    let num_blocks = cache.keys.len() / row;
    let capacity = batch.table_width * bs;
    for (seq, &len) in batch.seq_lens.iter().enumerate() {
        if len < 0 || len as usize > capacity {
            return Err(AttentionError::TooLong { seq, len: len.into(), capacity });
        }
        let table = &batch.block_tables[seq * batch.table_width..][..(len as usize).div_ceil(bs)];
        if let Some(&block) = table.iter().find(|&&b| b < 0 || b as usize >= num_blocks) {
            return Err(AttentionError::BlockOutOfRange { seq, block: block.into(), num_blocks });
        }
    }
    Ok(())
}

/// `sequence` compiled for AVX2: its helpers are inlined into it, so its loops use 8-wide vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sequence_avx2(
    cache: &PagedCache<'_>,
    batch: &DecodeBatch<'_>,
    scale: f32,
    seq: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    sequence::<true>(cache, batch, scale, seq, scores, out);
}

/// One sequence: scores of every row for every query head (keys read once), softmax per head,
/// then the weighted sum of the values (values read once). `scores` is [num_q_heads, len].
#[inline(always)]
fn sequence<'a, const AVX2: bool>(
    cache: &PagedCache<'a>,
    batch: &DecodeBatch<'_>,
    scale: f32,
    seq: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (bs, hkv, d, hq) = (cache.block_size, cache.num_kv_heads, cache.head_dim, batch.num_q_heads);
    let group = hq / hkv;
    let len = batch.seq_lens[seq] as usize;
    out.fill(0.0);
    if len == 0 {
        return;
    }
    let q = &batch.queries[seq * hq * d..][..hq * d];
    let table = &batch.block_tables[seq * batch.table_width..][..len.div_ceil(bs)];
    let row = hkv * d;
    // (first position, the block's rows) of each page: whole rows of the cache, no division per row.
    let pages = |cache_rows: &'a [f32]| {
        table.iter().enumerate().map(move |(p, &block)| {
            let n = bs.min(len - p * bs);
            (p * bs, &cache_rows[block as usize * bs * row..][..n * row])
        })
    };
    scores.clear();
    scores.resize(hq * len, 0.0);
    #[cfg(target_arch = "x86_64")]
    if AVX2 && crate::attention_avx2::serves(d) {
        let shape = crate::attention_avx2::Shape { row, head_dim: d, group, len, scale };
        let both = pages(cache.keys).zip(pages(cache.values)).map(|((first, k), (_, v))| (first, k, v));
        // SAFETY: only sequence_avx2 sets AVX2, and it runs where the CPU has AVX2 and FMA.
        unsafe { crate::attention_avx2::attend(&shape, q, both, scores, out) };
        return;
    }
    for (first, rows) in pages(cache.keys) {
        for (j, keys) in rows.chunks_exact(row).enumerate() {
            for (h, k) in keys.chunks_exact(d).enumerate() {
                for qh in h * group..(h + 1) * group {
                    scores[qh * len + first + j] = dot(&q[qh * d..][..d], k) * scale;
                }
            }
        }
    }
    // Loops, not closures: a closure would not be compiled for AVX2 inside sequence_avx2.
    for head in scores.chunks_exact_mut(len) {
        let max = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for s in head.iter_mut() {
            *s = exp(*s - max);
        }
        let inv = 1.0 / sum(head);
        for s in head.iter_mut() {
            *s *= inv;
        }
    }
    for (first, rows) in pages(cache.values) {
        for (j, values) in rows.chunks_exact(row).enumerate() {
            for (h, v) in values.chunks_exact(d).enumerate() {
                for qh in h * group..(h + 1) * group {
                    axpy(scores[qh * len + first + j], v, &mut out[qh * d..][..d]);
                }
            }
        }
    }
}

/// e^x for x <= 0 (a softmax's shifted scores), branch-free so a loop over it vectorizes (libm's
/// expf is a call per element: most of the kernel's time when it was used). Cephes' expf: x =
/// n ln 2 + r with |r| <= ln 2 / 2, a degree-6 polynomial for e^r, 2^n from the exponent bits;
/// relative error about 1e-7. Below -87 (where e^x underflows f32's normal range) it returns
/// e^-87, negligible next to the row's largest weight, 1.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 0.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_portable_path_agrees_with_the_dispatched_one() {
        let (bs, hkv, hq, d, lens) = (8, 2, 4, 16, [19i32, 8, 1]);
        let gen = |n: usize, k: usize| {
            (0..n).map(|i| ((i * 7919 + k) % 89) as f32 / 44.5 - 1.0).collect::<Vec<_>>()
        };
        let (keys, values, queries) =
            (gen(9 * bs * hkv * d, 1), gen(9 * bs * hkv * d, 2), gen(3 * hq * d, 3));
        let tables = [5, 1, 7, 2, 0, 0, 8, 0, 0];
        let cache =
            PagedCache { keys: &keys, values: &values, block_size: bs, num_kv_heads: hkv, head_dim: d };
        let batch = DecodeBatch {
            queries: &queries,
            num_q_heads: hq,
            block_tables: &tables,
            table_width: 3,
            seq_lens: &lens,
        };
        let mut dispatched = vec![0.0; queries.len()];
        decode_attention(&cache, &batch, 0.3, &mut dispatched).unwrap();
        let mut scores = Vec::new();
        for (seq, want) in dispatched.chunks_exact(hq * d).enumerate() {
            let mut got = vec![0.0; hq * d];
            sequence::<false>(&cache, &batch, 0.3, seq, &mut scores, &mut got);
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() <= 1e-5, "sequence {seq}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_libm_over_the_softmax_range() {
        let mut worst = 0.0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (super::exp(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(-1000.0) < 1e-37);
    }

    #[test]
    fn ranges_cover_every_sequence_once_with_about_equal_keys() {
        assert_eq!(balanced_ranges(&[10, 10, 10, 10], 2), vec![0..2, 2..4]);
        assert_eq!(balanced_ranges(&[100, 1, 1, 1], 2), vec![0..1, 1..4]);
        assert_eq!(balanced_ranges(&[5, 5], 8), vec![0..1, 1..2]); // never an empty range
        assert_eq!(balanced_ranges(&[0, 0, 0], 2), vec![0..1, 1..3]);
        assert_eq!(balanced_ranges(&[], 4), vec![]);
        let lens: Vec<i32> = (0..256).map(|i| 16 + i % 64).collect();
        let ranges = balanced_ranges(&lens, 8);
        assert_eq!((ranges.len(), ranges[0].start, ranges[7].end), (8, 0, 256));
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
        let keys: Vec<i32> = ranges.iter().map(|r| lens[r.clone()].iter().sum()).collect();
        let (least, most) = (keys.iter().min().unwrap(), keys.iter().max().unwrap());
        assert!(most - least <= 2 * 79, "{keys:?}"); // within two sequences' keys of each other
    }
}
