//! `gguf_repack_q4`, `gguf_requantize_int8`, `gguf_widen`: a GGUF file's quantized rows converted to the
//! layouts of pyserve's 4-bit and int8 layers (`pyserve-cpu-kernels`' `gguf_blocks`), into
//! arrays the caller allocated, with the GIL released and the rows spread over torch's team.

use half::f16;
use numpy::{PyReadonlyArray2, PyReadwriteArray1, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyserve_cpu_kernels::{repack_q4, requantize_int8, widen, BlockKind};

use crate::arrays::{contiguous, contiguous_mut};
use crate::openmp;

/// {GGUF type name: (weights, bytes) of a block} for every type these functions take.
pub fn block_sizes(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let sizes = PyDict::new(py);
    for kind in BlockKind::ALL {
        sizes.set_item(kind.name(), kind.weights_and_bytes())?;
    }
    Ok(sizes)
}

fn kind_of(name: &str) -> PyResult<BlockKind> {
    BlockKind::named(name)
        .ok_or_else(|| PyValueError::new_err(format!("kind: {name} is not a GGUF type converted here")))
}

/// Rows of `kind` blocks [rows, row bytes] as `packed` [rows, fan_in / 2] u8 (two weights a
/// byte, the even one low), `scales` and `offsets` [rows, fan_in / 32] f16 (Q4_0, Q4_1, Q4_K).
#[pyfunction]
#[pyo3(signature = (kind, blocks, packed, scales, offsets, threads=1))]
pub fn gguf_repack_q4(
    py: Python<'_>,
    kind: &str,
    blocks: PyReadonlyArray2<'_, u8>,
    mut packed: PyReadwriteArray2<'_, u8>,
    mut scales: PyReadwriteArray2<'_, f16>,
    mut offsets: PyReadwriteArray2<'_, f16>,
    threads: usize,
) -> PyResult<()> {
    let kind = kind_of(kind)?;
    let (rows, fan_in) = (blocks.shape()[0], packed.shape()[1] * 2);
    let blocks = contiguous("blocks", &blocks)?;
    let packed = contiguous_mut("packed", &mut packed)?;
    let scales = contiguous_mut("scales", &mut scales)?;
    let offsets = contiguous_mut("offsets", &mut offsets)?;
    py.detach(|| {
        openmp::on_team(threads, |pool| repack_q4(pool, kind, blocks, rows, fan_in, packed, scales, offsets))
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Rows of `kind` blocks [rows, row bytes] widened and rounded to int8 `q` [rows, fan_in] with
/// one `scales` [rows] f32 each (Q8_0, Q5_0, Q6_K).
#[pyfunction]
#[pyo3(signature = (kind, blocks, q, scales, threads=1))]
pub fn gguf_requantize_int8(
    py: Python<'_>,
    kind: &str,
    blocks: PyReadonlyArray2<'_, u8>,
    mut q: PyReadwriteArray2<'_, i8>,
    mut scales: PyReadwriteArray1<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let kind = kind_of(kind)?;
    let (rows, fan_in) = (blocks.shape()[0], q.shape()[1]);
    let blocks = contiguous("blocks", &blocks)?;
    let q = contiguous_mut("q", &mut q)?;
    let scales = contiguous_mut("scales", &mut scales)?;
    py.detach(|| {
        openmp::on_team(threads, |pool| requantize_int8(pool, kind, blocks, rows, fan_in, q, scales))
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Rows of `kind` blocks [rows, row bytes] widened to f32 `out` [rows, fan_in] with the gguf
/// package's arithmetic (any of the six types).
#[pyfunction]
#[pyo3(signature = (kind, blocks, out, threads=1))]
pub fn gguf_widen(
    py: Python<'_>,
    kind: &str,
    blocks: PyReadonlyArray2<'_, u8>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let kind = kind_of(kind)?;
    let (rows, fan_in) = (blocks.shape()[0], out.shape()[1]);
    let blocks = contiguous("blocks", &blocks)?;
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| openmp::on_team(threads, |pool| widen(pool, kind, blocks, rows, fan_in, out)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
