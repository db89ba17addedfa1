//! `linear`, `linear_q8`, `linear_q4`, `linear_w8a8`, `linear_kquant`: the CPU few-rows linear kernel of `pyserve-cpu-kernels`
//! over numpy views of the step's tensors (no copies), with the GIL released while it runs.

use half::f16;
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::project_on;

use crate::arrays::{contiguous, contiguous_mut};
use crate::openmp;
use crate::projection::{projection, Weight, W8A8_TAG};

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
    out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    run(py, x, Weight::F32(weight, bias), out, threads)
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
    out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    run(py, x, Weight::Q8(weight, scales, bias), out, threads)
}

/// out [rows, fan_out] f32 = ((xq [rows, fan_in] @ weight [fan_out, fan_in] int8 ^T) * sx) *
/// scales (+ bias), overwritten: each row of x quantized to int8 with a scale sx of its own, the
/// sums exact in int32 (w8a8).
#[pyfunction]
#[pyo3(signature = (x, weight, scales, bias, out, threads=1))]
pub fn linear_w8a8(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight: PyReadonlyArray2<'_, i8>,
    scales: PyReadonlyArray1<'_, f32>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    run(py, x, Weight::W8A8(weight, scales, bias, W8A8_TAG.to_owned()), out, threads)
}

/// out [rows, fan_out] f32 = x [rows, fan_in] f32 @ W^T (+ bias), overwritten: `linear` with
/// 4-bit weights, `packed` [fan_out, fan_in / 2] u8 (two a byte, the even one low), weight
/// q * scales + offsets per row and group of `group` inputs (scales, offsets [fan_out,
/// fan_in / group] f16); groups of 32 or more on x quantized to int16 per block of 32 inputs.
#[pyfunction]
#[pyo3(signature = (x, packed, scales, offsets, group, bias, out, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn linear_q4(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    packed: PyReadonlyArray2<'_, u8>,
    scales: PyReadonlyArray2<'_, f16>,
    offsets: PyReadonlyArray2<'_, f16>,
    group: usize,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    run(py, x, Weight::Q4(packed, scales, offsets, group, bias), out, threads)
}

/// out [rows, fan_out] f32 = x [rows, fan_in] f32 @ W^T (+ bias), overwritten: `linear` over a
/// GGUF file's rows of `kind` ("Q4_K", "Q4_1", ...) as it stores them: `blocks`, arrays [rows,
/// row bytes] u8 whose rows follow one another (fan_out in all); x quantized as the type's kernel
/// takes it (`pyserve_cpu_kernels::linear_kquant`).
#[pyfunction]
#[pyo3(signature = (x, blocks, kind, bias, out, threads=1))]
pub fn linear_kquant(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    blocks: Vec<PyReadonlyArray2<'_, u8>>,
    kind: String,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    run(py, x, Weight::KQuant(blocks, kind, bias), out, threads)
}

/// x [rows, fan_in] and out [rows, fan_out] checked against the weight, then the kernel of its kind.
fn run(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight: Weight<'_>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let weights = projection(&weight, None)?;
    let [fan_out, fan_in] = weight.shape();
    if x.shape()[1] != fan_in || out.shape() != [x.shape()[0], fan_out] {
        return Err(PyValueError::new_err(format!(
            "x and out: shapes {:?} and {:?} must be [rows, {fan_in}] and [rows, {fan_out}] for weight {:?}",
            x.shape(),
            out.shape(),
            [fan_out, fan_in]
        )));
    }
    let x = contiguous("x", &x)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| openmp::on_team(threads, |pool| project_on(pool, x, &weights, out)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
