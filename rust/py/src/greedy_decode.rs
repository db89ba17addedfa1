//! `greedy_decode`: a whole model's greedy guesses several tokens ahead in one call
//! (`pyserve-cpu-kernels`), over numpy views of its weights and its paged KV cache (no copies),
//! with the GIL released while it runs.

use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray4, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{greedy_decode_on, Feed, Heads, LayerWeights, ModelWeights, Requests, RopeTables};

use crate::arrays::{contiguous, contiguous_mut};
use crate::openmp;
use crate::projection::{projection, Weight};

/// One layer as `decoder_layer` takes it: (input_norm, qkv, o, post_norm, gate_up, down, eps).
type Layer<'py> = (
    PyReadonlyArray1<'py, f32>,
    Weight<'py>,
    Weight<'py>,
    PyReadonlyArray1<'py, f32>,
    Weight<'py>,
    Weight<'py>,
    f32,
);

/// Feeds each request its `feed_*` rows (token, position, request index; a request's rows in
/// position order), then guesses `depth[r]` tokens for request r, each the argmax of the logits
/// after the token before it. embed [vocab, hidden] f32; layers as `decoder_layer` takes them;
/// norm [hidden] and eps the final RMSNorm; head the output projection (a `Weight`);
/// k_caches, v_caches one [num_blocks, block_size, kv_heads, head_dim] array a layer;
/// block_tables [requests, width] int32; cos, sin [positions, head_dim]. Returns int32
/// [requests, max(depth)]: row r's first depth[r] values are its guesses, the rest -1.
/// ValueError names what is at fault.
#[pyfunction]
#[pyo3(signature = (embed, layers, norm, eps, head, heads, head_dim, kv_heads, k_caches, v_caches,
                    feed_tokens, feed_positions, feed_requests, block_tables, depth, cos, sin, scale,
                    threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn greedy_decode<'py>(
    py: Python<'py>,
    embed: PyReadonlyArray2<'py, f32>,
    layers: Vec<Layer<'py>>,
    norm: PyReadonlyArray1<'py, f32>,
    eps: f32,
    head: Weight<'py>,
    heads: usize,
    head_dim: usize,
    kv_heads: usize,
    mut k_caches: Vec<PyReadwriteArray4<'py, f32>>,
    mut v_caches: Vec<PyReadwriteArray4<'py, f32>>,
    feed_tokens: PyReadonlyArray1<'py, i32>,
    feed_positions: PyReadonlyArray1<'py, i64>,
    feed_requests: PyReadonlyArray1<'py, i64>,
    block_tables: PyReadonlyArray2<'py, i32>,
    depth: PyReadonlyArray1<'py, i64>,
    cos: PyReadonlyArray2<'py, f32>,
    sin: PyReadonlyArray2<'py, f32>,
    scale: f32,
    threads: usize,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    if k_caches.len() != v_caches.len() {
        return Err(PyValueError::new_err(format!(
            "k_caches and v_caches: {} and {} arrays",
            k_caches.len(),
            v_caches.len()
        )));
    }
    let block_size = match k_caches.first() {
        Some(k) => k.shape()[1],
        None => 1,
    };
    for (i, (k, v)) in k_caches.iter().zip(&v_caches).enumerate() {
        let shape = k.shape();
        if v.shape() != shape || shape[1] != block_size || shape[2] != kv_heads || shape[3] != head_dim {
            return Err(PyValueError::new_err(format!(
                "k_caches[{i}] and v_caches[{i}]: shapes {shape:?} and {:?} must both be [num_blocks, {block_size}, {kv_heads}, {head_dim}]",
                v.shape()
            )));
        }
    }
    let mut layer_weights = Vec::with_capacity(layers.len());
    for (input_norm, qkv, o, post_norm, gate_up, down, eps) in &layers {
        layer_weights.push(LayerWeights {
            input_norm: contiguous("input_norm", input_norm)?,
            qkv: projection(qkv, Some("qkv"))?,
            o: projection(o, Some("o"))?,
            post_norm: contiguous("post_norm", post_norm)?,
            gate_up: projection(gate_up, Some("gate_up"))?,
            down: projection(down, Some("down"))?,
            eps: *eps,
        });
    }
    let model = ModelWeights {
        embed: contiguous("embed", &embed)?,
        layers: layer_weights,
        norm: contiguous("norm", &norm)?,
        eps,
        head: projection(&head, Some("head"))?,
    };
    let nonnegative = |name: &str, values: &[i64]| -> PyResult<Vec<usize>> {
        values
            .iter()
            .map(|&v| {
                usize::try_from(v).map_err(|_| PyValueError::new_err(format!("{name}: {v} is negative")))
            })
            .collect()
    };
    let requests_of_rows = nonnegative("feed_requests", contiguous("feed_requests", &feed_requests)?)?;
    let depth = nonnegative("depth", contiguous("depth", &depth)?)?;
    let num_requests = depth.len();
    let feed = Feed {
        tokens: contiguous("feed_tokens", &feed_tokens)?,
        positions: contiguous("feed_positions", &feed_positions)?,
        requests: &requests_of_rows,
    };
    let requests = Requests {
        block_tables: contiguous("block_tables", &block_tables)?,
        table_width: block_tables.shape()[1],
        block_size,
        depth: &depth,
    };
    let rope = RopeTables { cos: contiguous("cos", &cos)?, sin: contiguous("sin", &sin)? };
    let mut caches = Vec::with_capacity(k_caches.len());
    for (i, (k, v)) in k_caches.iter_mut().zip(v_caches.iter_mut()).enumerate() {
        caches.push((
            contiguous_mut(&format!("k_caches[{i}]"), k)?,
            contiguous_mut(&format!("v_caches[{i}]"), v)?,
        ));
    }
    let heads = Heads { q: heads, kv: kv_heads, dim: head_dim };
    let guesses = py
        .detach(|| {
            openmp::on_team(threads, |pool| {
                greedy_decode_on(pool, &model, &heads, &mut caches, &rope, &feed, &requests, scale)
            })
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let width = depth.iter().copied().max().unwrap_or(0);
    let array =
        Array2::from_shape_vec((num_requests, width), guesses).expect("guesses: requests x max depth");
    Ok(array.into_pyarray(py))
}
