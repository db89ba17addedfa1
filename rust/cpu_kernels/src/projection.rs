//! A projection of a layer as it is stored: f32 weights (`linear`), int8 weights with one scale
//! per output channel (`linear_q8`), the same with int8 activations (`linear_w8a8`), or 4-bit
//! weights in groups (`linear_q4`). The decoder layer runs any kind.

use crate::linear::{linear_on, LinearError, LinearWeights};
use crate::linear_q4::{linear_q4_on, Q4Weights};
use crate::linear_q8::{linear_q8_on, Q8Weights};
use crate::linear_w8a8::{linear_w8a8_on, W8A8Weights};
use crate::parallel::ForkJoin;

pub enum Projection<'a> {
    F32(LinearWeights<'a>),
    Q8(Q8Weights<'a>),
    W8A8(W8A8Weights<'a>),
    Q4(Q4Weights<'a>),
}

impl Projection<'_> {
    pub fn fan_in(&self) -> usize {
        match self {
            Projection::F32(w) => w.fan_in,
            Projection::Q8(w) => w.fan_in,
            Projection::W8A8(w) => w.fan_in,
            Projection::Q4(w) => w.fan_in,
        }
    }

    pub fn fan_out(&self) -> usize {
        match self {
            Projection::F32(w) => w.fan_out,
            Projection::Q8(w) => w.fan_out,
            Projection::W8A8(w) => w.fan_out,
            Projection::Q4(w) => w.fan_out,
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
    }
}
