//! Multi-LoRA for CPUs: each token of a batch gets the delta of its own adapter.
//!
//! For a token `t` whose slot `s = token_slots[t]` is not negative, `y[t] += b_scaled[s]^T (a[s]
//! x[t])`: `rank` dot products over the input, then `rank` scaled rows of `b_scaled` added to the
//! output row. Tokens with a negative slot are left alone. One call per projection and no
//! grouping: on a CPU, the torch version of this (gather by slot, two batched matmuls, scatter
//! back) spent most of its time in per-op costs at decode sizes.
//!
//! Layouts (row-major, f32): `x [tokens, fan_in]`; `a [num_slots, rank, fan_in]`; `b_scaled
//! [num_slots, rank, fan_out]`, each slot's B transposed and multiplied by its adapter's scaling;
//! `y [tokens, fan_out]`. An adapter of a smaller rank than `rank` has zero rows past its own.

use crate::vector::{axpy, dot, has_avx2_fma};

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
    check(x, token_slots, weights, y)?;
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: has_avx2_fma found that the CPU supports AVX2 and FMA; `check` the shapes.
        unsafe { crate::lora_avx2::tokens(x, token_slots, weights, y) };
        return Ok(());
    }
    tokens(x, token_slots, weights, y);
    Ok(())
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

/// The portable kernel, one token at a time: `rank` dot products, then `rank` rows of B added.
/// (Blocked loops measured no faster: 16-18 GFLOP/s either way, compiled for AVX2, before
/// `lora_avx2`'s intrinsics.)
fn tokens(x: &[f32], token_slots: &[i64], w: &LoraWeights<'_>, y: &mut [f32]) {
    let rows = x.chunks_exact(w.fan_in).zip(y.chunks_exact_mut(w.fan_out));
    for ((x, y), &slot) in rows.zip(token_slots) {
        if slot < 0 {
            continue;
        }
        let s = slot as usize;
        let a = &w.a[s * w.rank * w.fan_in..][..w.rank * w.fan_in];
        let b = &w.b_scaled[s * w.rank * w.fan_out..][..w.rank * w.fan_out];
        for (a_row, b_row) in a.chunks_exact(w.fan_in).zip(b.chunks_exact(w.fan_out)) {
            axpy(dot(a_row, x), b_row, y);
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
        tokens(&x, &slots, &w, &mut portable);
        add_lora(&x, &slots, &w, &mut dispatched).unwrap();
        for (p, d) in portable.iter().zip(&dispatched) {
            assert!((p - d).abs() <= 1e-4 * (1.0 + p.abs()), "{p} vs {d}");
        }
        assert_eq!(portable[fo..2 * fo], y0[fo..2 * fo]);
    }
}
