//! Multi-LoRA for CPUs: each token of a batch gets the delta of its own adapter.
//!
//! For a token `t` whose slot `s = token_slots[t]` is not negative, `y[t] += b_scaled[s]^T (a[s]
//! x[t])`: `rank` dot products over the input, then `rank` scaled rows of `b_scaled` added to the
//! output row. Tokens with a negative slot are left alone. One call per projection, where torch
//! would gather by slot, run two batched matmuls and scatter back: at decode sizes those ops cost
//! a CPU mostly their per-op overhead.
//!
//! Layouts (row-major, f32): `x [tokens, fan_in]`; `a [num_slots, rank, fan_in]`; `b_scaled
//! [num_slots, rank, fan_out]`, each slot's B transposed and multiplied by its adapter's scaling;
//! `y [tokens, fan_out]`. An adapter of a smaller rank than `rank` has zero rows past its own.
//!
//! The work: tokens grouped by slot, in blocks of up to `BLOCK` tokens of one slot (the AVX2
//! half, `lora_avx2`, reads each vector of B once per block). `add_lora_on` spreads the blocks
//! over the threads of a `ForkJoin`; every token is in at most one block, so each row of `y` has
//! one writer.

use std::ops::Range;

use crate::parallel::{ForkJoin, OnCallingThread, MIN_PARALLEL_WORK, PARTS_PER_THREAD};
use crate::vector::{axpy, dot};

/// Tokens of one slot per block: four tokens by sixteen outputs is eight independent vector sums
/// in the AVX2 half, enough to keep both FMA units busy.
pub(crate) const BLOCK: usize = 4;

/// A slot and up to `BLOCK` of its tokens.
pub(crate) type Block<'a> = (usize, &'a [usize]);

/// The stacked adapters of one projection, one per slot.
pub struct LoraWeights<'a> {
    pub a: &'a [f32],
    pub b_scaled: &'a [f32],
    pub num_slots: usize,
    pub rank: usize,
    pub fan_in: usize,
    pub fan_out: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LoraError {
    #[error("{0}")]
    Shape(String),
    #[error("token {token}: slot {slot} is outside the {num_slots} slots")]
    SlotOutOfRange { token: usize, slot: i64, num_slots: usize },
}

/// Adds each token's LoRA delta to its row of `y`.
pub fn add_lora(
    x: &[f32],
    token_slots: &[i64],
    weights: &LoraWeights<'_>,
    y: &mut [f32],
) -> Result<(), LoraError> {
    add_lora_on(&OnCallingThread, x, token_slots, weights, y)
}

/// `add_lora` with the blocks spread over the threads of `pool` (`PARTS_PER_THREAD` ranges of
/// blocks per thread). The result is the same bits as on one thread.
pub fn add_lora_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    token_slots: &[i64],
    weights: &LoraWeights<'_>,
    y: &mut [f32],
) -> Result<(), LoraError> {
    check(x, token_slots, weights, y)?;
    let groups = by_slot(token_slots, weights.num_slots);
    let blocks = blocks(&groups);
    let tokens: usize = groups.iter().map(Vec::len).sum();
    let work = tokens * weights.rank * (weights.fan_in + weights.fan_out);
    let parts =
        if work < MIN_PARALLEL_WORK { 1 } else { blocks.len().min(PARTS_PER_THREAD * pool.threads()) };
    let rows = SharedRows { ptr: y.as_mut_ptr(), len: y.len() };
    let run = |range: Range<usize>| run_blocks(x, &blocks[range], weights, &rows);
    if parts <= 1 {
        run(0..blocks.len());
    } else {
        let n = blocks.len();
        pool.run(parts, &|i| run(i * n / parts..(i + 1) * n / parts));
    }
    Ok(())
}

/// The tokens of each slot, in order; tokens with a negative slot are in none.
fn by_slot(token_slots: &[i64], num_slots: usize) -> Vec<Vec<usize>> {
    let mut groups = vec![Vec::new(); num_slots];
    for (t, &s) in token_slots.iter().enumerate() {
        if s >= 0 {
            groups[s as usize].push(t);
        }
    }
    groups
}

/// Each slot's tokens in blocks of up to `BLOCK`.
fn blocks(groups: &[Vec<usize>]) -> Vec<Block<'_>> {
    groups.iter().enumerate().flat_map(|(s, g)| g.chunks(BLOCK).map(move |b| (s, b))).collect()
}

/// The rows of `y`, written by several threads at once, each only the rows of its own blocks'
/// tokens (no two blocks share a token).
pub(crate) struct SharedRows {
    pub ptr: *mut f32,
    pub len: usize,
}

// SAFETY: the threads sharing it write disjoint rows (see above).
unsafe impl Sync for SharedRows {}

impl SharedRows {
    /// Row `t` of `n` floats. Safety: no other reference to that row is alive.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn row(&self, t: usize, n: usize) -> &mut [f32] {
        assert!((t + 1) * n <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(t * n), n)
    }
}

/// The blocks of one range, on the calling thread.
fn run_blocks(x: &[f32], blocks: &[Block<'_>], w: &LoraWeights<'_>, y: &SharedRows) {
    #[cfg(target_arch = "x86_64")]
    if crate::vector::avx2_fma_available() {
        // SAFETY: the CPU has AVX2 and FMA; `check` passed; the blocks' rows of `y` are ours.
        return unsafe { crate::lora_avx2::run_blocks(x, blocks, w, y) };
    }
    run_blocks_portable(x, blocks, w, y)
}

fn check(x: &[f32], token_slots: &[i64], w: &LoraWeights<'_>, y: &[f32]) -> Result<(), LoraError> {
    let shape = |msg: String| Err(LoraError::Shape(msg));
    let (n, r) = (token_slots.len(), w.rank);
    if w.a.len() != w.num_slots * r * w.fan_in {
        return shape(format!("a must be [{}, {r}, {}]", w.num_slots, w.fan_in));
    }
    if w.b_scaled.len() != w.num_slots * r * w.fan_out {
        return shape(format!("b_scaled must be [{}, {r}, {}]", w.num_slots, w.fan_out));
    }
    if x.len() != n * w.fan_in {
        return shape(format!("x must be [{n}, {}]", w.fan_in));
    }
    if y.len() != n * w.fan_out {
        return shape(format!("y must be [{n}, {}]", w.fan_out));
    }
    if let Some((token, &slot)) = token_slots.iter().enumerate().find(|(_, &s)| s >= w.num_slots as i64) {
        return Err(LoraError::SlotOutOfRange { token, slot, num_slots: w.num_slots });
    }
    Ok(())
}

/// `run_blocks` without intrinsics, one token at a time: `rank` dot products, then `rank` rows of
/// B added.
fn run_blocks_portable(x: &[f32], blocks: &[Block<'_>], w: &LoraWeights<'_>, y: &SharedRows) {
    for &(slot, tokens) in blocks {
        let a = &w.a[slot * w.rank * w.fan_in..][..w.rank * w.fan_in];
        let b = &w.b_scaled[slot * w.rank * w.fan_out..][..w.rank * w.fan_out];
        for &t in tokens {
            let x = &x[t * w.fan_in..][..w.fan_in];
            // SAFETY: token t is in this block only, and this block in one range.
            let y = unsafe { y.row(t, w.fan_out) };
            for (a_row, b_row) in a.chunks_exact(w.fan_in).zip(b.chunks_exact(w.fan_out)) {
                axpy(dot(a_row, x), b_row, y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_portable_kernel_agrees_with_the_dispatched_one() {
        // slot 1 has five tokens (a block of four, then one), slot 0 two, slot 2 one
        let (slots, r, fi, fo) = ([1i64, -1, 0, 1, 1, 1, 0, 1, 2], 6, 19, 53);
        let gen = |n: usize, k: usize| {
            (0..n).map(|i| ((i * 7919 + k) % 97) as f32 / 48.5 - 1.0).collect::<Vec<_>>()
        };
        let (x, a, b, y0) = (gen(9 * fi, 1), gen(3 * r * fi, 2), gen(3 * r * fo, 3), gen(9 * fo, 4));
        let w = LoraWeights { a: &a, b_scaled: &b, num_slots: 3, rank: r, fan_in: fi, fan_out: fo };
        let (mut portable, mut dispatched) = (y0.clone(), y0.clone());
        let groups = by_slot(&slots, 3);
        let rows = SharedRows { ptr: portable.as_mut_ptr(), len: portable.len() };
        run_blocks_portable(&x, &blocks(&groups), &w, &rows);
        add_lora(&x, &slots, &w, &mut dispatched).unwrap();
        for (p, d) in portable.iter().zip(&dispatched) {
            assert!((p - d).abs() <= 1e-4 * (1.0 + p.abs()), "{p} vs {d}");
        }
        assert_eq!(portable[fo..2 * fo], y0[fo..2 * fo]);
    }
}
