//! `eagle_greedy`: an EAGLE-3 head's feed and greedy guesses in one call (`pyserve-cpu-kernels`),
//! over numpy views of its weights, the target's features and the head's paged KV cache (no
//! copies), with the GIL released while it runs.

use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray4, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{eagle_greedy_on, BlockTables, Feed, HeadWeights, Heads, Pairs, RopeTables};

use crate::arrays::{contiguous, contiguous_mut};
use crate::decoder_layer::{check_cache, layer_weights, Layer};
use crate::openmp;
use crate::projection::{projection, Weight};
use crate::whole_model::{indices, Embed};

/// The head as Python passes it (by these attribute names).
#[derive(FromPyObject)]
pub struct Head<'py> {
    fc: Weight<'py>,
    embed: Embed<'py>,
    hidden_norm: PyReadonlyArray1<'py, f32>,
    layer: Layer<'py>,
    norm: PyReadonlyArray1<'py, f32>,
    lm_head: Weight<'py>,
    target_ids: PyReadonlyArray1<'py, i64>,
    heads: usize,
    head_dim: usize,
    kv_heads: usize,
    cos: PyReadonlyArray2<'py, f32>,
    sin: PyReadonlyArray2<'py, f32>,
    scale: f32,
}

/// Feeds the pairs (row i: the target's features [rows, fc's inputs] f32 at feed_positions[i] of
/// request feed_requests[i], with feed_tokens[i] the token after it; a request's rows in position
/// order), then guesses depth[r] tokens for request r, each fed back with the head's output for
/// the next. Returns int32 [requests, max(depth)] target ids: row r's first depth[r] values are its
/// guesses, the rest -1. `head`: (fc, embed [vocab, hidden] f32 or (blocks, GGUF type),
/// hidden_norm, layer as `decoder_layer` takes it (its qkv over 2 * hidden; input_norm: the
/// embedding's), norm, lm_head, target_ids [draft vocab] int64, heads, head_dim, kv_heads, cos,
/// sin [positions, head_dim], scale); k_cache, v_cache [num_blocks, block_size, kv_heads,
/// head_dim]; block_tables [requests, width] int32. ValueError names what is at fault, before any
/// write.
#[pyfunction]
#[pyo3(signature = (head, k_cache, v_cache, features, feed_tokens, feed_positions, feed_requests, block_tables,
                    depth, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn eagle_greedy<'py>(
    py: Python<'py>,
    head: Head<'py>,
    mut k_cache: PyReadwriteArray4<'py, f32>,
    mut v_cache: PyReadwriteArray4<'py, f32>,
    features: PyReadonlyArray2<'py, f32>,
    feed_tokens: PyReadonlyArray1<'py, i32>,
    feed_positions: PyReadonlyArray1<'py, i64>,
    feed_requests: PyReadonlyArray1<'py, i64>,
    block_tables: PyReadonlyArray2<'py, i32>,
    depth: PyReadonlyArray1<'py, i64>,
    threads: usize,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let shape = check_cache(k_cache.shape(), v_cache.shape(), head.kv_heads, head.head_dim)?;
    let depth = indices("depth", contiguous("depth", &depth)?)?;
    let weights = HeadWeights {
        fc: projection(&head.fc, Some("fc"))?,
        embed: head.embed.view()?,
        hidden_norm: contiguous("hidden_norm", &head.hidden_norm)?,
        layer: layer_weights(&head.layer)?,
        norm: contiguous("norm", &head.norm)?,
        lm_head: projection(&head.lm_head, Some("lm_head"))?,
        target_ids: contiguous("target_ids", &head.target_ids)?,
    };
    let requests = indices("feed_requests", contiguous("feed_requests", &feed_requests)?)?;
    let pairs = Pairs {
        features: contiguous("features", &features)?,
        feed: Feed {
            tokens: contiguous("feed_tokens", &feed_tokens)?,
            positions: contiguous("feed_positions", &feed_positions)?,
            requests: &requests,
        },
    };
    let tables = BlockTables {
        tables: contiguous("block_tables", &block_tables)?,
        width: block_tables.shape()[1],
        block_size: shape[1],
    };
    let rope = RopeTables { cos: contiguous("cos", &head.cos)?, sin: contiguous("sin", &head.sin)? };
    let heads = Heads { q: head.heads, kv: head.kv_heads, dim: head.head_dim };
    let cache = (contiguous_mut("k_cache", &mut k_cache)?, contiguous_mut("v_cache", &mut v_cache)?);
    let guesses = py
        .detach(|| {
            openmp::on_team(threads, |pool| {
                eagle_greedy_on(pool, &weights, &heads, cache, &rope, &pairs, &tables, &depth, head.scale)
            })
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let width = depth.iter().copied().max().unwrap_or(0);
    let array = Array2::from_shape_vec((depth.len(), width), guesses).expect("guesses: requests x max depth");
    Ok(array.into_pyarray(py))
}
