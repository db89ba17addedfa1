//! Paged decode attention for CPUs.
//!
//! One query token per sequence attends to the sequence's cached keys and values, read in place
//! from a paged cache through its block table: each cached row is read once, where a gather into
//! a padded dense tensor followed by a dense attention reads it twice and writes it once. On
//! CPUs, whose decode attention is bound by memory bandwidth, that is the whole cost; inside the
//! engine a step's rows are mostly out of cache, so spreading the sequences over threads pays.
//! AVX2 where the CPU has it (`attention_avx2`).
//!
//! Layouts (row-major, f32): cache `[num_blocks, block_size, num_kv_heads, head_dim]` for keys
//! and values alike; queries and output `[num_seqs, num_q_heads, head_dim]`; block tables
//! `[num_seqs, table_width]`. Query head `h` reads kv head `h / (num_q_heads / num_kv_heads)`
//! (grouped-query attention). A sequence of length 0 gets zeros. A sequence may hide some of
//! its last 64 keys (`DecodeBatch::masks`: a token of a token tree sees its own path only).
//!
//! The kernel: checks, then each sequence in two passes over its rows. `decode_attention` runs
//! on the calling thread; `decode_attention_on` runs parts on the threads of a `ForkJoin` the
//! caller lends, never on a pool of its own (see `parallel`): ranges of sequences of about equal
//! numbers of keys, or, where there are fewer sequences than parts (a batch of one decoding a
//! long context), each sequence's kv heads apart: a query head's output depends on its own kv
//! head's rows only, so either split gives the bits of one thread.

use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use crate::parallel::{ForkJoin, OnCallingThread, MIN_PARALLEL_WORK, PARTS_PER_THREAD};
use crate::vector::{axpy, dot, exp, sum};

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
    /// Per sequence, which of its last 64 keys it sees: bit `b` for key `len - 1 - b` (older
    /// keys are always seen). None: every key.
    pub masks: Option<&'a [u64]>,
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

/// `decode_attention` with the work spread over the threads of `pool`: each thread takes ranges
/// of sequences (`PARTS_PER_THREAD` per thread, of about equal numbers of keys), or with fewer
/// sequences than that, (sequence, kv head) pairs, and writes their rows of `out`. The result is
/// the same bits as on one thread.
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
    let parts = if keys * per_seq < MIN_PARALLEL_WORK { 1 } else { PARTS_PER_THREAD * pool.threads() };
    let num_seqs = batch.seq_lens.len();
    if parts > 1 && num_seqs < parts && cache.num_kv_heads > 1 {
        by_kv_heads(pool, cache, batch, scale, out);
        return Ok(());
    }
    let ranges = balanced_ranges(batch.seq_lens, parts);
    if ranges.len() <= 1 {
        run_sequences(cache, batch, scale, 0..num_seqs, out);
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
        run_sequences(cache, batch, scale, ranges[i].clone(), &mut out);
    });
    Ok(())
}

/// Each (sequence, kv head) pair a part: its query heads' rows of `out`.
fn by_kv_heads(
    pool: &dyn ForkJoin,
    cache: &PagedCache<'_>,
    batch: &DecodeBatch<'_>,
    scale: f32,
    out: &mut [f32],
) {
    let hkv = cache.num_kv_heads;
    let width = batch.num_q_heads / hkv * cache.head_dim; // a kv head's query heads in a row of out
    let outs: Vec<Mutex<&mut [f32]>> = out.chunks_exact_mut(width).map(Mutex::new).collect();
    pool.run(outs.len(), &|i| {
        let mut out = outs[i].lock().unwrap_or_else(PoisonError::into_inner);
        out.fill(0.0);
        if let Some(seq) = Sequence::new(cache, batch, i / hkv) {
            attend_heads(&seq.of_kv_head(i % hkv), cache, scale, &mut Vec::new(), &mut out);
        }
    });
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
fn run_sequences(
    cache: &PagedCache<'_>,
    batch: &DecodeBatch<'_>,
    scale: f32,
    seqs: Range<usize>,
    out: &mut [f32],
) {
    let mut scores = Vec::new();
    for (i, out) in seqs.zip(out.chunks_exact_mut(batch.num_q_heads * cache.head_dim)) {
        out.fill(0.0);
        if let Some(seq) = Sequence::new(cache, batch, i) {
            attend_heads(&seq, cache, scale, &mut scores, out);
        }
    }
}

/// One sequence's query heads (all, or a kv head's) into `out`, which starts zeroed, with AVX2
/// where the CPU has it.
fn attend_heads(
    seq: &Sequence<'_>,
    cache: &PagedCache<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx2_fma_available() {
        // SAFETY: the CPU has AVX2 and FMA; `check` passed.
        return unsafe { crate::attention_avx2::attend_heads(seq, cache, scale, scores, out) };
    }
    attend(seq, cache, scale, scores, out)
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
    if !cache.keys.len().is_multiple_of(row) || cache.values.len() != cache.keys.len() {
        return shape("keys and values must both be [num_blocks, block_size, num_kv_heads, head_dim]".into());
    }
    let num_seqs = batch.seq_lens.len();
    if batch.queries.len() != num_seqs * hq * d || out.len() != batch.queries.len() {
        return shape(format!("queries and out must be [{num_seqs}, {hq}, {d}]"));
    }
    if batch.masks.is_some_and(|m| m.len() != num_seqs) {
        return shape(format!("masks must be [{num_seqs}]"));
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

/// One sequence as both halves of the kernel read it: its query heads, and its rows of the cache
/// page by page through its block table.
pub(crate) struct Sequence<'b> {
    /// [query heads, head_dim]: all the sequence's, or those of kv head `first_kv` on
    pub q: &'b [f32],
    /// The kv head of q's first head.
    pub first_kv: usize,
    /// Its keys, at least one.
    pub len: usize,
    pub head_dim: usize,
    /// Query heads per kv head.
    pub group: usize,
    /// Floats in a row of the cache: one position's keys (or values) of all kv heads.
    pub row: usize,
    block_size: usize,
    table: &'b [i32],
    /// Bit `b` clear: key `len - 1 - b` is hidden.
    mask: u64,
}

impl<'b> Sequence<'b> {
    /// Sequence `seq` of the batch, or None while it has no keys.
    #[inline(always)]
    pub fn new(cache: &PagedCache<'_>, batch: &DecodeBatch<'b>, seq: usize) -> Option<Self> {
        let (bs, hkv, d, hq) = (cache.block_size, cache.num_kv_heads, cache.head_dim, batch.num_q_heads);
        let len = batch.seq_lens[seq] as usize;
        if len == 0 {
            return None;
        }
        Some(Sequence {
            q: &batch.queries[seq * hq * d..][..hq * d],
            first_kv: 0,
            len,
            head_dim: d,
            group: hq / hkv,
            row: hkv * d,
            block_size: bs,
            table: &batch.block_tables[seq * batch.table_width..][..len.div_ceil(bs)],
            mask: batch.masks.map_or(u64::MAX, |m| m[seq]),
        })
    }

    /// The sequence's query heads of kv head `h` only.
    pub fn of_kv_head(&self, h: usize) -> Self {
        let width = self.group * self.head_dim;
        Sequence { q: &self.q[h * width..][..width], first_kv: h, ..*self }
    }

    /// Before the softmax: one head's scores (`len` of them) with the hidden keys at minus
    /// infinity, so that the maximum is over the seen keys.
    #[inline(always)]
    pub fn hide_scores(&self, head: &mut [f32]) {
        self.for_hidden(|j| head[j] = f32::NEG_INFINITY);
    }

    /// After the softmax: the hidden keys' weights exactly zero (the softmax's exp clamps its
    /// argument, which leaves them tiny, not zero).
    #[inline(always)]
    pub fn zero_hidden(&self, head: &mut [f32]) {
        self.for_hidden(|j| head[j] = 0.0);
    }

    #[inline(always)]
    fn for_hidden(&self, mut f: impl FnMut(usize)) {
        let mut hidden = !self.mask;
        while hidden != 0 {
            let b = hidden.trailing_zeros() as usize;
            if b >= self.len {
                return;
            }
            f(self.len - 1 - b);
            hidden &= hidden - 1;
        }
    }

    /// (first position, the block's rows) of each page of `rows`, the cache's keys or values:
    /// whole rows of the cache, no division per row.
    #[inline(always)]
    pub fn pages<'a>(
        &self,
        rows: &'a [f32],
    ) -> impl Iterator<Item = (usize, &'a [f32])> + Clone + use<'a, 'b> {
        let (bs, len, row) = (self.block_size, self.len, self.row);
        self.table.iter().enumerate().map(
            #[inline(always)]
            move |(p, &block)| {
                let n = bs.min(len - p * bs);
                (p * bs, &rows[block as usize * bs * row..][..n * row])
            },
        )
    }
}

/// One sequence: scores of every row for every query head (keys read once), softmax per head,
/// then the weighted sum of the values (values read once) into `out`, which starts zeroed.
/// `scores` is scratch, [num_q_heads, len] here.
#[inline(always)]
pub(crate) fn attend(
    seq: &Sequence<'_>,
    cache: &PagedCache<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (d, group, len, row) = (seq.head_dim, seq.group, seq.len, seq.row);
    let q = seq.q;
    let kv_heads = seq.first_kv..seq.first_kv + q.len() / d / group;
    scores.clear();
    scores.resize(q.len() / d * len, 0.0);
    for (first, rows) in seq.pages(cache.keys) {
        for (j, keys) in rows.chunks_exact(row).enumerate() {
            for (h, k) in kv_heads.clone().zip(keys[kv_heads.start * d..].chunks_exact(d)) {
                let h = h - kv_heads.start;
                for qh in h * group..(h + 1) * group {
                    scores[qh * len + first + j] = dot(&q[qh * d..][..d], k) * scale;
                }
            }
        }
    }
    for head in scores.chunks_exact_mut(len) {
        seq.hide_scores(head);
        let max = head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for s in head.iter_mut() {
            *s = exp(*s - max);
        }
        let inv = 1.0 / sum(head);
        for s in head.iter_mut() {
            *s *= inv;
        }
        seq.zero_hidden(head);
    }
    for (first, rows) in seq.pages(cache.values) {
        for (j, values) in rows.chunks_exact(row).enumerate() {
            for (h, v) in kv_heads.clone().zip(values[kv_heads.start * d..].chunks_exact(d)) {
                let h = h - kv_heads.start;
                for qh in h * group..(h + 1) * group {
                    axpy(scores[qh * len + first + j], v, &mut out[qh * d..][..d]);
                }
            }
        }
    }
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
            masks: Some(&[u64::MAX, 0b1011, !0b110]),
        };
        let (mut portable, mut dispatched) = (vec![0.0; queries.len()], vec![0.0; queries.len()]);
        for (i, out) in portable.chunks_exact_mut(hq * d).enumerate() {
            if let Some(seq) = Sequence::new(&cache, &batch, i) {
                attend(&seq, &cache, 0.3, &mut Vec::new(), out);
            }
        }
        decode_attention(&cache, &batch, 0.3, &mut dispatched).unwrap();
        for (seq, (got, want)) in
            portable.chunks_exact(hq * d).zip(dispatched.chunks_exact(hq * d)).enumerate()
        {
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() <= 1e-5, "sequence {seq}: {g} vs {w}");
            }
        }
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
