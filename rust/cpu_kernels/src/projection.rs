//! A projection of a layer as it is stored: f32 weights (`linear`), int8 weights with one scale
//! per output channel (`linear_q8`), the same with int8 activations (`linear_w8a8`), 4-bit
//! weights in groups (`linear_q4`), a GGUF file's K-quant rows (`linear_kquant`), or several of
//! these side by side (`Parts`: a layer whose q, k and v are stored in different kinds, as GGUF
//! files may store them). The decoder layer runs any kind.

use crate::linear::{linear_on, LinearError, LinearWeights};
use crate::linear_kquant::{linear_kquant_on, KQuantWeights};
use crate::linear_q4::{linear_q4_on, Q4Weights};
use crate::linear_q8::{linear_q8_on, Q8Weights};
use crate::linear_w8a8::{linear_w8a8_on, W8A8Weights};
use crate::parallel::ForkJoin;

pub enum Projection<'a> {
    F32(LinearWeights<'a>),
    Q8(Q8Weights<'a>),
    W8A8(W8A8Weights<'a>),
    Q4(Q4Weights<'a>),
    KQuant(KQuantWeights<'a>),
    /// The outputs of each part in turn, over the same inputs.
    Parts(Vec<Projection<'a>>),
}

impl Projection<'_> {
    pub fn fan_in(&self) -> usize {
        match self {
            Projection::F32(w) => w.fan_in,
            Projection::Q8(w) => w.fan_in,
            Projection::W8A8(w) => w.fan_in,
            Projection::Q4(w) => w.fan_in,
            Projection::KQuant(w) => w.fan_in,
            Projection::Parts(parts) => parts.first().map_or(0, Projection::fan_in),
        }
    }

    pub fn fan_out(&self) -> usize {
        match self {
            Projection::F32(w) => w.fan_out,
            Projection::Q8(w) => w.fan_out,
            Projection::W8A8(w) => w.fan_out,
            Projection::Q4(w) => w.fan_out,
            Projection::KQuant(w) => w.fan_out,
            Projection::Parts(parts) => parts.iter().map(Projection::fan_out).sum(),
        }
    }
}

/// `y = x W^T + bias` with the kernel of the projection's kind.
pub fn project_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    p: &Projection<'_>,
    y: &mut [f32],
) -> Result<(), LinearError> {
    match p {
        Projection::F32(w) => linear_on(pool, x, w, y),
        Projection::Q8(w) => linear_q8_on(pool, x, w, y),
        Projection::W8A8(w) => linear_w8a8_on(pool, x, w, y),
        Projection::Q4(w) => linear_q4_on(pool, x, w, y),
        Projection::KQuant(w) => linear_kquant_on(pool, x, w, y),
        Projection::Parts(parts) => parts_on(pool, x, parts, y),
    }
}

/// Each part's outputs into its columns of y: written in place where there is one row, else
/// computed apart and copied into each row.
fn parts_on(
    pool: &dyn ForkJoin,
    x: &[f32],
    parts: &[Projection<'_>],
    y: &mut [f32],
) -> Result<(), LinearError> {
    let Some(first) = parts.first() else {
        return Err(LinearError::new("parts: a projection of parts needs at least one".to_owned()));
    };
    let fan_in = first.fan_in();
    if let Some((i, p)) = parts.iter().enumerate().find(|(_, p)| p.fan_in() != fan_in) {
        return Err(LinearError::new(format!(
            "parts: part {i} takes {} inputs, part 0 takes {fan_in}",
            p.fan_in()
        )));
    }
    let width: usize = parts.iter().map(Projection::fan_out).sum();
    if fan_in == 0 || !x.len().is_multiple_of(fan_in) || y.len() != x.len() / fan_in * width {
        return Err(LinearError::new(format!(
            "parts: x has {} values and y {} for {fan_in} inputs and {width} outputs a row",
            x.len(),
            y.len()
        )));
    }
    let rows = x.len() / fan_in;
    let mut start = 0;
    for p in parts {
        let n = p.fan_out();
        if rows == 1 {
            project_on(pool, x, p, &mut y[start..start + n])?;
        } else {
            let mut part = vec![0.0f32; rows * n];
            project_on(pool, x, p, &mut part)?;
            for (row, out) in y.chunks_exact_mut(width).zip(part.chunks_exact(n)) {
                row[start..start + n].copy_from_slice(out);
            }
        }
        start += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::tests::{values, TwoParts};
    use crate::linear_q8::Q8Weights;

    #[test]
    fn parts_give_each_part_s_bits_in_its_columns() {
        let k = 64;
        let (wf, bf) = (values(5 * k, 1), values(5, 2));
        let w8: Vec<i8> = values(3 * k, 3).iter().map(|v| (v * 127.0) as i8).collect();
        let s8 = values(3, 4);
        let float = || Projection::F32(LinearWeights { weight: &wf, bias: Some(&bf), fan_in: k, fan_out: 5 });
        let int8 =
            || Projection::Q8(Q8Weights { weight: &w8, scales: &s8, bias: None, fan_in: k, fan_out: 3 });
        for rows in [1, 3] {
            let x = values(rows * k, 5);
            let (mut a, mut b) = (vec![0.0f32; rows * 5], vec![0.0f32; rows * 3]);
            project_on(&TwoParts, &x, &float(), &mut a).unwrap();
            project_on(&TwoParts, &x, &int8(), &mut b).unwrap();
            let mut y = vec![f32::NAN; rows * 8];
            project_on(&TwoParts, &x, &Projection::Parts(vec![float(), int8()]), &mut y).unwrap();
            for r in 0..rows {
                assert_eq!(&y[r * 8..r * 8 + 5], &a[r * 5..][..5]);
                assert_eq!(&y[r * 8 + 5..][..3], &b[r * 3..][..3]);
            }
        }
    }

    #[test]
    fn parts_of_different_fan_ins_are_refused() {
        let (wa, wb) = (values(2 * 8, 1), values(2 * 16, 2));
        let parts = Projection::Parts(vec![
            Projection::F32(LinearWeights { weight: &wa, bias: None, fan_in: 8, fan_out: 2 }),
            Projection::F32(LinearWeights { weight: &wb, bias: None, fan_in: 16, fan_out: 2 }),
        ]);
        let err = project_on(&TwoParts, &values(8, 3), &parts, &mut [0.0; 4]).unwrap_err();
        assert_eq!(err.to_string(), "parts: part 1 takes 16 inputs, part 0 takes 8");
    }
}
