//! `linear`: the CPU few-rows linear kernel of `pyserve-cpu-kernels` over numpy views of the
//! step's tensors (no copies), with the GIL released while it runs.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{linear_on, linear_q4_on, linear_q8_on, LinearWeights, Q4Weights, Q8Weights};

use crate::arrays::{contiguous, contiguous_mut};
use crate::openmp;

/// out [rows, fan_out] f32 = x [rows, fan_in] f32 @ weight [fan_out, fan_in] f32 ^T (+ bias
/// [fan_out] f32), overwritten. ValueError names the argument at fault. With `threads` > 1 the
/// outputs are spread over the calling thread's OpenMP team (torch's), where one is loaded.
#[pyfunction]
#[pyo3(signature = (x, weight, bias, out, threads=1))]
pub fn linear(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight: PyReadonlyArray2<'_, f32>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let (fan_out, fan_in) = (weight.shape()[0], weight.shape()[1]);
    check_shapes(x.shape(), out.shape(), weight.shape())?;
    let weights = LinearWeights {
        weight: contiguous("weight", &weight)?,
        bias: bias.as_ref().map(|b| contiguous("bias", b)).transpose()?,
        fan_in,
        fan_out,
    };
    let x = contiguous("x", &x)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| openmp::on_team(threads, |pool| linear_on(pool, x, &weights, out)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// out [rows, fan_out] f32 = (x [rows, fan_in] f32 @ weight [fan_out, fan_in] int8 ^T) * scales
/// [fan_out] f32 (+ bias), overwritten: `linear` with int8 weights, one scale per output channel.
#[pyfunction]
#[pyo3(signature = (x, weight, scales, bias, out, threads=1))]
pub fn linear_q8(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight: PyReadonlyArray2<'_, i8>,
    scales: PyReadonlyArray1<'_, f32>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let (fan_out, fan_in) = (weight.shape()[0], weight.shape()[1]);
    check_shapes(x.shape(), out.shape(), weight.shape())?;
    let weights = Q8Weights {
        weight: contiguous("weight", &weight)?,
        scales: contiguous("scales", &scales)?,
        bias: bias.as_ref().map(|b| contiguous("bias", b)).transpose()?,
        fan_in,
        fan_out,
    };
    let x = contiguous("x", &x)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| openmp::on_team(threads, |pool| linear_q8_on(pool, x, &weights, out)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// out [rows, fan_out] f32 = x [rows, fan_in] f32 @ W^T (+ bias), overwritten: `linear` with
/// 4-bit weights, `packed` [fan_out, fan_in / 2] u8 (two a byte, the even one low), dequantized
/// as q * scales + offsets per row and group of `group` inputs (scales, offsets [fan_out,
/// fan_in / group] f32).
#[pyfunction]
#[pyo3(signature = (x, packed, scales, offsets, group, bias, out, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn linear_q4(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    packed: PyReadonlyArray2<'_, u8>,
    scales: PyReadonlyArray2<'_, f32>,
    offsets: PyReadonlyArray2<'_, f32>,
    group: usize,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let (fan_out, fan_in) = (packed.shape()[0], packed.shape()[1] * 2);
    check_shapes(x.shape(), out.shape(), &[fan_out, fan_in])?;
    let weights = Q4Weights {
        packed: contiguous("packed", &packed)?,
        scales: contiguous("scales", &scales)?,
        offsets: contiguous("offsets", &offsets)?,
        group,
        bias: bias.as_ref().map(|b| contiguous("bias", b)).transpose()?,
        fan_in,
        fan_out,
    };
    let x = contiguous("x", &x)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| openmp::on_team(threads, |pool| linear_q4_on(pool, x, &weights, out)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// x [rows, fan_in] and out [rows, fan_out] for a weight [fan_out, fan_in].
fn check_shapes(x: &[usize], out: &[usize], weight: &[usize]) -> PyResult<()> {
    let (fan_out, fan_in) = (weight[0], weight[1]);
    if x[1] != fan_in || out != [x[0], fan_out] {
        return Err(PyValueError::new_err(format!(
            "x and out: shapes {x:?} and {out:?} must be [rows, {fan_in}] and [rows, {fan_out}] for weight {weight:?}"
        )));
    }
    Ok(())
}
