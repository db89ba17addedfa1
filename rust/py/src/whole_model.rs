//! `model_forward` and `greedy_decode`: a whole model over a few rows in one call
//! (`pyserve-cpu-kernels`), over numpy views of its weights and its paged KV cache (no copies),
//! with the GIL released while it runs.

use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray4, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyserve_cpu_kernels::{
    greedy_decode_on, model_forward_on, BlockKind, BlockTables, Embedding, Feed, ForkJoin, Heads, LayerError,
    ModelWeights, RopeTables,
};

use crate::arrays::{contiguous, contiguous_mut};
use crate::decoder_layer::{layer_weights, Layer};
use crate::openmp;
use crate::projection::{projection, Weight};

/// What both functions take: the model, its caches, the rows and the requests' block tables.
#[derive(FromPyObject)]
pub struct Model<'py> {
    embed: Embed<'py>,
    layers: Vec<Layer<'py>>,
    norm: PyReadonlyArray1<'py, f32>,
    eps: f32,
    head: Weight<'py>,
    heads: usize,
    head_dim: usize,
    kv_heads: usize,
    cos: PyReadonlyArray2<'py, f32>,
    sin: PyReadonlyArray2<'py, f32>,
    scale: f32,
}

/// An embedding table: f32 [vocab, hidden], or (GGUF blocks [vocab, row bytes] u8, their type's name).
#[derive(FromPyObject)]
pub enum Embed<'py> {
    F32(PyReadonlyArray2<'py, f32>),
    Blocks(PyReadonlyArray2<'py, u8>, String),
}

impl Embed<'_> {
    pub fn view(&self) -> PyResult<Embedding<'_>> {
        Ok(match self {
            Embed::F32(table) => Embedding::F32(contiguous("embed", table)?),
            Embed::Blocks(blocks, kind) => Embedding::Blocks {
                kind: BlockKind::named(kind).ok_or_else(|| {
                    PyValueError::new_err(format!("embed: {kind:?} is not a GGUF block type"))
                })?,
                blocks: contiguous("embed", blocks)?,
            },
        })
    }
}

fn negative(name: &str, v: i64) -> PyErr {
    PyValueError::new_err(format!("{name}: {v} is negative"))
}

pub fn indices(name: &str, values: &[i64]) -> PyResult<Vec<usize>> {
    values.iter().map(|&v| usize::try_from(v).map_err(|_| negative(name, v))).collect()
}

/// Runs `kernel` over the kernels' views of the arguments, with the GIL released.
#[allow(clippy::too_many_arguments)]
fn run<R: Send>(
    py: Python<'_>,
    model: &Model<'_>,
    k_caches: &mut [PyReadwriteArray4<'_, f32>],
    v_caches: &mut [PyReadwriteArray4<'_, f32>],
    feed_tokens: &PyReadonlyArray1<'_, i32>,
    feed_positions: &PyReadonlyArray1<'_, i64>,
    feed_requests: &PyReadonlyArray1<'_, i64>,
    block_tables: &PyReadonlyArray2<'_, i32>,
    threads: usize,
    kernel: impl FnOnce(
            &dyn ForkJoin,
            &ModelWeights<'_>,
            &Heads,
            &mut [(&mut [f32], &mut [f32])],
            &RopeTables<'_>,
            &Feed<'_>,
            &BlockTables<'_>,
        ) -> Result<R, LayerError>
        + Send,
) -> PyResult<R> {
    if k_caches.len() != v_caches.len() {
        return Err(PyValueError::new_err(format!(
            "k_caches and v_caches: {} and {} arrays",
            k_caches.len(),
            v_caches.len()
        )));
    }
    let block_size = k_caches.first().map_or(1, |k| k.shape()[1]);
    for (i, (k, v)) in k_caches.iter().zip(v_caches.iter()).enumerate() {
        let shape = k.shape();
        if v.shape() != shape
            || shape[1] != block_size
            || shape[2] != model.kv_heads
            || shape[3] != model.head_dim
        {
            return Err(PyValueError::new_err(format!(
                "k_caches[{i}] and v_caches[{i}]: shapes {shape:?} and {:?} must both be [num_blocks, {block_size}, {}, {}]",
                v.shape(),
                model.kv_heads,
                model.head_dim
            )));
        }
    }
    let weights = ModelWeights {
        embed: model.embed.view()?,
        layers: model.layers.iter().map(layer_weights).collect::<PyResult<_>>()?,
        norm: contiguous("norm", &model.norm)?,
        eps: model.eps,
        head: projection(&model.head, Some("head"))?,
    };
    let requests = indices("feed_requests", contiguous("feed_requests", feed_requests)?)?;
    let feed = Feed {
        tokens: contiguous("feed_tokens", feed_tokens)?,
        positions: contiguous("feed_positions", feed_positions)?,
        requests: &requests,
    };
    let tables = BlockTables {
        tables: contiguous("block_tables", block_tables)?,
        width: block_tables.shape()[1],
        block_size,
    };
    let rope = RopeTables { cos: contiguous("cos", &model.cos)?, sin: contiguous("sin", &model.sin)? };
    let mut caches = Vec::with_capacity(k_caches.len());
    for (i, (k, v)) in k_caches.iter_mut().zip(v_caches.iter_mut()).enumerate() {
        caches.push((
            contiguous_mut(&format!("k_caches[{i}]"), k)?,
            contiguous_mut(&format!("v_caches[{i}]"), v)?,
        ));
    }
    let heads = Heads { q: model.heads, kv: model.kv_heads, dim: model.head_dim };
    py.detach(|| {
        openmp::on_team(threads, |pool| kernel(pool, &weights, &heads, &mut caches, &rope, &feed, &tables))
    })
    .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// One forward over the rows (feed_tokens int32, feed_positions int64, feed_requests int64: row
/// i's request, a request's rows in position order), their keys and values written to the
/// caches; returns the float32 logits [len(logits_rows), vocab] of the rows `logits_rows` and the
/// float32 inputs [rows, len(aux_layers) * hidden] of the layers `aux_layers` (increasing; empty:
/// [rows, 0]).
/// `model`: (embed [vocab, hidden] f32 or (blocks, GGUF type), layers as `decoder_layer` takes them, norm [hidden], eps,
/// head (a `Weight`), heads, head_dim, kv_heads, cos, sin [positions, head_dim], scale);
/// k_caches, v_caches one [num_blocks, block_size, kv_heads, head_dim] array a layer;
/// block_tables [requests, width] int32. ValueError names what is at fault, before any write.
#[pyfunction]
#[pyo3(signature = (model, k_caches, v_caches, feed_tokens, feed_positions, feed_requests, block_tables,
                    logits_rows, aux_layers, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn model_forward<'py>(
    py: Python<'py>,
    model: Model<'py>,
    mut k_caches: Vec<PyReadwriteArray4<'py, f32>>,
    mut v_caches: Vec<PyReadwriteArray4<'py, f32>>,
    feed_tokens: PyReadonlyArray1<'py, i32>,
    feed_positions: PyReadonlyArray1<'py, i64>,
    feed_requests: PyReadonlyArray1<'py, i64>,
    block_tables: PyReadonlyArray2<'py, i32>,
    logits_rows: PyReadonlyArray1<'py, i64>,
    aux_layers: PyReadonlyArray1<'py, i64>,
    threads: usize,
) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<f32>>)> {
    let picked = indices("logits_rows", contiguous("logits_rows", &logits_rows)?)?;
    let aux_layers = indices("aux_layers", contiguous("aux_layers", &aux_layers)?)?;
    let vocab = model.head.shape()[0];
    let rows = feed_tokens.len();
    let out = run(
        py,
        &model,
        &mut k_caches,
        &mut v_caches,
        &feed_tokens,
        &feed_positions,
        &feed_requests,
        &block_tables,
        threads,
        |pool, weights, heads, caches, rope, feed, tables| {
            model_forward_on(
                pool,
                weights,
                heads,
                caches,
                rope,
                feed,
                tables,
                model.scale,
                &picked,
                &aux_layers,
            )
        },
    )?;
    let logits = Array2::from_shape_vec((picked.len(), vocab), out.logits).expect("logits: rows x vocab");
    let width = if rows == 0 { 0 } else { out.aux.len() / rows };
    let aux = Array2::from_shape_vec((rows, width), out.aux).expect("aux: rows x layers * hidden");
    Ok((logits.into_pyarray(py), aux.into_pyarray(py)))
}

/// Feeds the rows (as `model_forward`), then guesses depth[r] tokens for request r, each the
/// argmax of the logits after the token before it, fed back for the next. Returns int32
/// [requests, max(depth)]: row r's first depth[r] values are its guesses, the rest -1.
#[pyfunction]
#[pyo3(signature = (model, k_caches, v_caches, feed_tokens, feed_positions, feed_requests, block_tables,
                    depth, threads=1))]
#[allow(clippy::too_many_arguments)]
pub fn greedy_decode<'py>(
    py: Python<'py>,
    model: Model<'py>,
    mut k_caches: Vec<PyReadwriteArray4<'py, f32>>,
    mut v_caches: Vec<PyReadwriteArray4<'py, f32>>,
    feed_tokens: PyReadonlyArray1<'py, i32>,
    feed_positions: PyReadonlyArray1<'py, i64>,
    feed_requests: PyReadonlyArray1<'py, i64>,
    block_tables: PyReadonlyArray2<'py, i32>,
    depth: PyReadonlyArray1<'py, i64>,
    threads: usize,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let depth = indices("depth", contiguous("depth", &depth)?)?;
    let guesses = run(
        py,
        &model,
        &mut k_caches,
        &mut v_caches,
        &feed_tokens,
        &feed_positions,
        &feed_requests,
        &block_tables,
        threads,
        |pool, weights, heads, caches, rope, feed, tables| {
            greedy_decode_on(pool, weights, heads, caches, rope, feed, tables, &depth, model.scale)
        },
    )?;
    let width = depth.iter().copied().max().unwrap_or(0);
    let array = Array2::from_shape_vec((depth.len(), width), guesses).expect("guesses: requests x max depth");
    Ok(array.into_pyarray(py))
}
