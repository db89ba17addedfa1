//! `paged_decode_attention`: the CPU decode kernel of `pyserve-cpu-kernels` over numpy views of
//! the step's tensors (no copies), with the GIL released while it runs.

use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray3,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{decode_attention_on, DecodeBatch, PagedCache};

use crate::arrays::{contiguous, contiguous_mut};
use crate::openmp;

/// q [num_seqs, num_q_heads, head_dim] f32; k_cache, v_cache [num_blocks, block_size,
/// num_kv_heads, head_dim] f32; block_tables [num_seqs, width] int32; seq_lens [num_seqs] int32
/// (keys per sequence, the new one included); `out` like q, overwritten; `masks` [num_seqs]
/// uint64 or None: bit b clear hides a sequence's key `len - 1 - b` (a token tree's rows see
/// their own path only). ValueError names the
/// argument at fault. With `threads` > 1 the sequences are spread over the calling thread's
/// OpenMP team (torch's), where one is loaded.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, scale, out, threads=1, masks=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    py: Python<'_>,
    q: PyReadonlyArray3<'_, f32>,
    k_cache: PyReadonlyArray4<'_, f32>,
    v_cache: PyReadonlyArray4<'_, f32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    scale: f32,
    mut out: PyReadwriteArray3<'_, f32>,
    threads: usize,
    masks: Option<PyReadonlyArray1<'_, u64>>,
) -> PyResult<()> {
    let cache_shape = k_cache.shape().to_vec();
    if v_cache.shape() != cache_shape.as_slice() {
        return Err(PyValueError::new_err(format!(
            "v_cache: shape {:?} differs from k_cache's {cache_shape:?}",
            v_cache.shape()
        )));
    }
    let q_shape = q.shape().to_vec();
    if q_shape[2] != cache_shape[3] || out.shape() != q_shape.as_slice() {
        return Err(PyValueError::new_err(format!(
            "q and out: shapes {q_shape:?} and {:?} must both be [num_seqs, num_q_heads, {}]",
            out.shape(),
            cache_shape[3]
        )));
    }
    if seq_lens.len() != q_shape[0] || block_tables.shape()[0] != q_shape[0] {
        return Err(PyValueError::new_err(format!(
            "seq_lens and block_tables: one row per sequence of q ({}) expected",
            q_shape[0]
        )));
    }
    let table_width = block_tables.shape()[1];
    let cache = PagedCache {
        keys: contiguous("k_cache", &k_cache)?,
        values: contiguous("v_cache", &v_cache)?,
        block_size: cache_shape[1],
        num_kv_heads: cache_shape[2],
        head_dim: cache_shape[3],
    };
    let batch = DecodeBatch {
        queries: contiguous("q", &q)?,
        num_q_heads: q_shape[1],
        block_tables: contiguous("block_tables", &block_tables)?,
        table_width,
        seq_lens: contiguous("seq_lens", &seq_lens)?,
        masks: masks.as_ref().map(|m| contiguous("masks", m)).transpose()?,
    };
    let out = contiguous_mut("out", &mut out)?;
    py.detach(|| openmp::on_team(threads, |pool| decode_attention_on(pool, &cache, &batch, scale, out)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
