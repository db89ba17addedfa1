//! The decoder-layer ops of `pyserve-cpu-kernels` (`rms_norm`, `add_rms_norm`, `silu_mul`,
//! `rotary`) over numpy views of the step's tensors (no copies), with the GIL released.

use numpy::{PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::LayerOpError;

use crate::arrays::{contiguous, contiguous_mut};

fn value_error(e: LayerOpError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// out = x / sqrt(mean(x^2, last axis) + eps) * weight; f32, C-contiguous, rows of weight's length.
#[pyfunction]
pub fn rms_norm(
    py: Python<'_>,
    x: PyReadonlyArrayDyn<'_, f32>,
    weight: PyReadonlyArrayDyn<'_, f32>,
    eps: f32,
    mut out: PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<()> {
    let (x, weight) = (contiguous("x", &x)?, contiguous("weight", &weight)?);
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| pyserve_cpu_kernels::rms_norm(x, weight, eps, out)).map_err(value_error)
}

/// residual += delta, then out = rms_norm(residual, weight, eps).
#[pyfunction]
pub fn add_rms_norm(
    py: Python<'_>,
    delta: PyReadonlyArrayDyn<'_, f32>,
    mut residual: PyReadwriteArrayDyn<'_, f32>,
    weight: PyReadonlyArrayDyn<'_, f32>,
    eps: f32,
    mut out: PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<()> {
    let (delta, weight) = (contiguous("delta", &delta)?, contiguous("weight", &weight)?);
    let residual = contiguous_mut("residual", &mut residual)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| pyserve_cpu_kernels::add_rms_norm(delta, residual, weight, eps, out)).map_err(value_error)
}

/// out [rows, width] = silu(gate_up[:, :width]) * gate_up[:, width:].
#[pyfunction]
pub fn silu_mul(
    py: Python<'_>,
    gate_up: PyReadonlyArrayDyn<'_, f32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<()> {
    let width = *out.shape().last().unwrap_or(&0);
    let gate_up = contiguous("gate_up", &gate_up)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| pyserve_cpu_kernels::silu_mul(gate_up, out, width)).map_err(value_error)
}

/// Rotates heads 0..heads of each row of x [rows, row_width] in place ("rotate half" RoPE), with
/// cos and sin [rows, head_dim].
#[pyfunction]
pub fn rotary(
    py: Python<'_>,
    mut x: PyReadwriteArrayDyn<'_, f32>,
    heads: usize,
    head_dim: usize,
    cos: PyReadonlyArrayDyn<'_, f32>,
    sin: PyReadonlyArrayDyn<'_, f32>,
) -> PyResult<()> {
    let row_width = *x.shape().last().unwrap_or(&0);
    let (cos, sin) = (contiguous("cos", &cos)?, contiguous("sin", &sin)?);
    let x = contiguous_mut("x", &mut x)?;
    py.detach(|| pyserve_cpu_kernels::rotary(x, row_width, heads, head_dim, cos, sin)).map_err(value_error)
}
