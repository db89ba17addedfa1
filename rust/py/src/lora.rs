//! `lora_add`: the CPU multi-LoRA kernel of `pyserve-cpu-kernels` over numpy views of the step's
//! tensors (no copies), with the GIL released while it runs.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{add_lora_on, LoraWeights};

use crate::arrays::{contiguous, contiguous_mut};
use crate::openmp;

/// y [tokens, fan_out] f32, updated in place; x [tokens, fan_in] f32; token_slots [tokens] int64
/// (-1: no adapter); lora_a [num_slots, rank, fan_in] f32; b_scaled [num_slots, rank, fan_out] f32
/// (B transposed, times the adapter's scaling). ValueError names the argument at fault. With
/// `threads` > 1 the work is spread over the calling thread's OpenMP team (torch's), where one
/// is loaded.
#[pyfunction]
#[pyo3(signature = (y, x, token_slots, lora_a, b_scaled, threads=1))]
pub fn lora_add(
    py: Python<'_>,
    mut y: PyReadwriteArray2<'_, f32>,
    x: PyReadonlyArray2<'_, f32>,
    token_slots: PyReadonlyArray1<'_, i64>,
    lora_a: PyReadonlyArray3<'_, f32>,
    b_scaled: PyReadonlyArray3<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let (a_shape, b_shape) = (lora_a.shape().to_vec(), b_scaled.shape().to_vec());
    if b_shape[..2] != a_shape[..2] {
        return Err(PyValueError::new_err(format!(
            "b_scaled: shape {b_shape:?} must be [{}, {}, fan_out] like lora_a {a_shape:?}",
            a_shape[0], a_shape[1]
        )));
    }
    let weights = LoraWeights {
        a: contiguous("lora_a", &lora_a)?,
        b_scaled: contiguous("b_scaled", &b_scaled)?,
        num_slots: a_shape[0],
        rank: a_shape[1],
        fan_in: a_shape[2],
        fan_out: b_shape[2],
    };
    let (x, token_slots) = (contiguous("x", &x)?, contiguous("token_slots", &token_slots)?);
    let y = contiguous_mut("y", &mut y)?;
    py.detach(|| openmp::on_team(threads, |pool| add_lora_on(pool, x, token_slots, &weights, y)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
