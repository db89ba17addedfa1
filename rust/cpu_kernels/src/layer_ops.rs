//! The small ops of a decoder layer over a few rows, one call each where torch takes five to ten
//! (each a dispatch, an allocation and a pass over the rows): RMSNorm, with the residual add
//! before it; the SiLU-gated product of an MLP; rotary position embedding in place.
//!
//! Each follows Hugging Face's Llama op for op in f32 (the same products and sums, in the
//! order written there), but for the sums of squares, whose order is this crate's `dot`.
//! Layouts are row-major f32; every row is independent of the others.

use crate::vector::dot;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct LayerOpError(String);

fn rows_of(name: &str, len: usize, width: usize) -> Result<usize, LayerOpError> {
    if width == 0 || !len.is_multiple_of(width) {
        return Err(LayerOpError(format!("{name}: {len} values is not a whole number of rows of {width}")));
    }
    Ok(len / width)
}

fn same_len(name: &str, got: usize, want: usize) -> Result<(), LayerOpError> {
    if got != want {
        return Err(LayerOpError(format!("{name}: {got} values, {want} expected")));
    }
    Ok(())
}

/// `out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight`, rows of `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), LayerOpError> {
    rows_of("x", x.len(), weight.len())?;
    same_len("out", out.len(), x.len())?;
    for (x, out) in x.chunks_exact(weight.len()).zip(out.chunks_exact_mut(weight.len())) {
        normalize(x, weight, eps, out);
    }
    Ok(())
}

/// `residual += delta`, then `out = rms_norm(residual)`: a sublayer's output joins the residual
/// stream and the next sublayer's input is normalized from it, in one pass.
pub fn add_rms_norm(
    delta: &[f32],
    residual: &mut [f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), LayerOpError> {
    rows_of("residual", residual.len(), weight.len())?;
    same_len("delta", delta.len(), residual.len())?;
    same_len("out", out.len(), residual.len())?;
    let d = weight.len();
    for ((delta, res), out) in
        delta.chunks_exact(d).zip(residual.chunks_exact_mut(d)).zip(out.chunks_exact_mut(d))
    {
        for (r, x) in res.iter_mut().zip(delta) {
            *r += x;
        }
        normalize(res, weight, eps, out);
    }
    Ok(())
}

#[inline(always)]
fn normalize(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let scale = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, x), w) in out.iter_mut().zip(x).zip(weight) {
        *o = x * scale * w;
    }
}

/// `out[r] = silu(gate[r]) * up[r]` where row r of `gate_up` is `gate[r]` then `up[r]`, each
/// `out`'s row width; silu(g) = g / (1 + e^-g).
pub fn silu_mul(gate_up: &[f32], out: &mut [f32], width: usize) -> Result<(), LayerOpError> {
    let rows = rows_of("gate_up", gate_up.len(), 2 * width)?;
    same_len("out", out.len(), rows * width)?;
    for (gu, out) in gate_up.chunks_exact(2 * width).zip(out.chunks_exact_mut(width)) {
        let (gate, up) = gu.split_at(width);
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
    Ok(())
}

/// Rotates heads `0..heads` of each row of `x` (rows of `row_width`, heads of `head_dim`
/// side by side from the row's start) in place, by the "rotate half" form:
/// `x * cos + rotate_half(x) * sin`, with `cos` and `sin` one row of `head_dim` per row of `x`.
pub fn rotary(
    x: &mut [f32],
    row_width: usize,
    heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) -> Result<(), LayerOpError> {
    let rows = rows_of("x", x.len(), row_width)?;
    if !head_dim.is_multiple_of(2) || heads * head_dim > row_width {
        return Err(LayerOpError(format!(
            "heads: {heads} heads of {head_dim} (an even size) must fit in rows of {row_width}"
        )));
    }
    same_len("cos", cos.len(), rows * head_dim)?;
    same_len("sin", sin.len(), rows * head_dim)?;
    let half = head_dim / 2;
    for (r, row) in x.chunks_exact_mut(row_width).enumerate() {
        let (c, s) = (&cos[r * head_dim..][..head_dim], &sin[r * head_dim..][..head_dim]);
        for head in row[..heads * head_dim].chunks_exact_mut(head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * c[i] + -b * s[i];
                hi[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_a_known_row() {
        let (x, w) = ([3.0f32, -4.0, 0.0, 0.0], [1.0f32, 2.0, 1.0, 1.0]);
        let mut out = [0.0; 4];
        rms_norm(&x, &w, 0.0, &mut out).unwrap();
        // mean of squares 25 / 4: scale 0.4
        assert_eq!(out, [1.2, -3.2, 0.0, 0.0]);
    }

    #[test]
    fn add_rms_norm_updates_the_residual_then_normalizes_it() {
        let (delta, w) = ([1.0f32, -1.0, 2.0, 0.0], [1.0f32; 4]);
        let mut residual = [2.0f32, -3.0, -2.0, 0.0];
        let mut out = [0.0; 4];
        add_rms_norm(&delta, &mut residual, &w, 0.0, &mut out).unwrap();
        assert_eq!(residual, [3.0, -4.0, 0.0, 0.0]);
        let mut want = [0.0; 4];
        rms_norm(&residual, &w, 0.0, &mut want).unwrap();
        assert_eq!(out, want);
    }

    #[test]
    fn silu_mul_gates_the_second_half_by_the_first() {
        let gate_up = [0.0f32, 2.0, 5.0, 3.0, 0.0, 0.0, 1.0, -1.0];
        let mut out = [0.0; 4];
        silu_mul(&gate_up, &mut out, 2).unwrap();
        let silu = |g: f32| g / (1.0 + (-g).exp());
        assert_eq!(out, [0.0, silu(2.0) * 3.0, 0.0, 0.0]);
        assert!((out[1] - 2.0 * 0.880_797 * 3.0).abs() < 1e-5);
    }

    #[test]
    fn rotary_rotates_the_named_heads_and_leaves_the_rest() {
        // one row: two heads of 4 then 2 untouched values; angle 90 degrees on pair 0, 0 on pair 1
        let mut x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        let (cos, sin) = ([0.0f32, 1.0, 0.0, 1.0], [1.0f32, 0.0, 1.0, 0.0]);
        rotary(&mut x, 10, 2, 4, &cos, &sin).unwrap();
        assert_eq!(x, [-3.0, 2.0, 1.0, 4.0, -7.0, 6.0, 5.0, 8.0, 9.0, 10.0]);
    }

    #[test]
    fn bad_shapes_are_errors_naming_the_argument() {
        let mut out = [0.0; 4];
        assert!(rms_norm(&[0.0; 5], &[1.0; 4], 0.0, &mut out).unwrap_err().0.starts_with("x:"));
        assert!(silu_mul(&[0.0; 8], &mut out[..3], 2).unwrap_err().0.starts_with("out:"));
        let mut x = [0.0; 8];
        assert!(rotary(&mut x, 8, 3, 4, &[0.0; 4], &[0.0; 4]).unwrap_err().0.starts_with("heads:"));
        assert!(rotary(&mut x, 8, 2, 4, &[0.0; 3], &[0.0; 4]).unwrap_err().0.starts_with("cos:"));
    }
}
