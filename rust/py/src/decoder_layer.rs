//! `decoder_layer`: one Llama-family layer over a few rows (`pyserve-cpu-kernels`), over numpy
//! views of the model's weights, the step's tensors and the layer's KV cache (no copies), with
//! the GIL released while it runs.

use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyReadwriteArray4, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{decoder_layer_on, Heads, LayerWeights, PagedCacheMut, RowLayout};

use crate::arrays::{contiguous, contiguous_mut};
use crate::openmp;
use crate::projection::{projection, Weight};

/// One layer's parameters as Python passes them: (input_norm, qkv, o, post_norm, gate_up, down,
/// eps).
pub type Layer<'py> = (
    PyReadonlyArray1<'py, f32>,
    Weight<'py>,
    Weight<'py>,
    PyReadonlyArray1<'py, f32>,
    Weight<'py>,
    Weight<'py>,
    f32,
);

/// The kernel's view of `layer` (no copies); an array that is not C-contiguous is named.
pub fn layer_weights<'a>(layer: &'a Layer<'_>) -> PyResult<LayerWeights<'a>> {
    let (input_norm, qkv, o, post_norm, gate_up, down, eps) = layer;
    Ok(LayerWeights {
        input_norm: contiguous("input_norm", input_norm)?,
        qkv: projection(qkv, Some("qkv"))?,
        o: projection(o, Some("o"))?,
        post_norm: contiguous("post_norm", post_norm)?,
        gate_up: projection(gate_up, Some("gate_up"))?,
        down: projection(down, Some("down"))?,
        eps: *eps,
    })
}

/// A layer's k_cache and v_cache shapes checked alike, `[num_blocks, block_size, kv_heads,
/// head_dim]`; returns the shape.
pub fn check_cache(k: &[usize], v: &[usize], kv_heads: usize, head_dim: usize) -> PyResult<Vec<usize>> {
    if v != k || k.len() != 4 || k[2] != kv_heads || k[3] != head_dim {
        return Err(PyValueError::new_err(format!(
            "k_cache and v_cache: shapes {k:?} and {v:?} must both be [num_blocks, block_size, {kv_heads}, {head_dim}]"
        )));
    }
    Ok(k.to_vec())
}

/// x [rows, hidden] f32 (the residual stream) updated in place by the layer. Linear layers come
/// as (weight [fan_out, fan_in] f32, bias [fan_out] or None) or quantized (`Weight`: int8 or
/// 4-bit); `qkv` has q's then k's then v's outputs
/// and `gate_up` gate's then up's. k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
/// per row: slots [rows] int64, block_tables [rows, width] int32, seq_lens [rows] int32 (keys
/// with the row's own), cos, sin [rows, head_dim]; masks [rows] uint64 or None (keys a row
/// hides, as `paged_decode_attention` takes them). ValueError names what is at fault. With
/// `threads` > 1 the linears and attention run on the calling thread's OpenMP team (torch's).
#[pyfunction]
#[pyo3(signature = (x, input_norm, qkv, o, post_norm, gate_up, down, eps, heads, head_dim,
                    kv_heads, k_cache, v_cache, slots, block_tables, seq_lens, cos, sin, scale, threads=1,
                    masks=None))]
#[allow(clippy::too_many_arguments)]
pub fn decoder_layer(
    py: Python<'_>,
    mut x: PyReadwriteArray2<'_, f32>,
    input_norm: PyReadonlyArray1<'_, f32>,
    qkv: Weight<'_>,
    o: Weight<'_>,
    post_norm: PyReadonlyArray1<'_, f32>,
    gate_up: Weight<'_>,
    down: Weight<'_>,
    eps: f32,
    heads: usize,
    head_dim: usize,
    kv_heads: usize,
    mut k_cache: PyReadwriteArray4<'_, f32>,
    mut v_cache: PyReadwriteArray4<'_, f32>,
    slots: PyReadonlyArray1<'_, i64>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
    scale: f32,
    threads: usize,
    masks: Option<PyReadonlyArray1<'_, u64>>,
) -> PyResult<()> {
    let cache_shape = check_cache(k_cache.shape(), v_cache.shape(), kv_heads, head_dim)?;
    let layer = (input_norm, qkv, o, post_norm, gate_up, down, eps);
    let weights = layer_weights(&layer)?;
    let rows = RowLayout {
        slots: contiguous("slots", &slots)?,
        table_width: block_tables.shape()[1],
        block_tables: contiguous("block_tables", &block_tables)?,
        seq_lens: contiguous("seq_lens", &seq_lens)?,
        masks: masks.as_ref().map(|m| contiguous("masks", m)).transpose()?,
        cos: contiguous("cos", &cos)?,
        sin: contiguous("sin", &sin)?,
    };
    let cache = PagedCacheMut {
        keys: contiguous_mut("k_cache", &mut k_cache)?,
        values: contiguous_mut("v_cache", &mut v_cache)?,
        block_size: cache_shape[1],
    };
    let x = contiguous_mut("x", &mut x)?;
    let heads = Heads { q: heads, kv: kv_heads, dim: head_dim };
    py.detach(|| {
        openmp::on_team(threads, |pool| decoder_layer_on(pool, x, &weights, &heads, cache, &rows, scale))
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}
