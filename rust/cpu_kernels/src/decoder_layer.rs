//! One Llama-family decoder layer over a few rows, in one call: the composition of this crate's
//! kernels that `pyserve/model/decoder.py` runs op by op, with no interpreter between the ops.
//!
//! `x` (the residual stream, `[rows, hidden]`) becomes `x + attn(norm(x))`, then that plus
//! `mlp(norm(.))`: RMSNorm, the fused q/k/v projection, rotary embedding of q and k, the new keys
//! and values written to their cache slots, paged attention of every row over its own prefix
//! (`attention`, each row a one-token query with its own block table and length), the output
//! projection, the residual add with the second RMSNorm, the fused gate/up projection, the
//! SiLU-gated product, the down projection and the residual add. Each step is the same kernel on
//! the same values as the op-by-op path, so the result has its bits.

use crate::attention::{decode_attention_on, AttentionError, DecodeBatch, PagedCache};
use crate::layer_ops::{add_rms_norm, rms_norm, rotary, silu_mul, LayerOpError};
use crate::linear::LinearError;
use crate::parallel::ForkJoin;
use crate::projection::{project_on, Projection};

/// The parameters of one layer; `qkv` holds q's, k's then v's outputs, `gate_up` gate's then up's.
pub struct LayerWeights<'a> {
    pub input_norm: &'a [f32],
    pub qkv: Projection<'a>,
    pub o: Projection<'a>,
    pub post_norm: &'a [f32],
    pub gate_up: Projection<'a>,
    pub down: Projection<'a>,
    pub eps: f32,
}

/// Attention heads: `q` query heads, `kv` key/value heads, each of `dim` values.
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
}

/// Where each row's key and value go and what it attends: its cache slot, its block table
/// (`table_width` entries a row), its length with itself, and its rotary cos/sin (`dim` each).
pub struct RowLayout<'a> {
    pub slots: &'a [i64],
    pub block_tables: &'a [i32],
    pub table_width: usize,
    pub seq_lens: &'a [i32],
    /// Keys each row hides (`DecodeBatch::masks`); None: none.
    pub masks: Option<&'a [u64]>,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// One layer's paged cache, written here: `[num_blocks, block_size, kv heads, dim]` each.
pub struct PagedCacheMut<'a> {
    pub keys: &'a mut [f32],
    pub values: &'a mut [f32],
    pub block_size: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayerError {
    #[error("{0}")]
    Shape(String),
    #[error("row {row}: slot {slot} is outside the cache's {capacity} slots")]
    SlotOutOfRange { row: usize, slot: i64, capacity: usize },
    #[error(transparent)]
    Linear(#[from] LinearError),
    #[error(transparent)]
    Op(#[from] LayerOpError),
    #[error(transparent)]
    Attention(#[from] AttentionError),
}

/// Runs the layer on `x` in place; linears and attention on the threads of `pool`.
pub fn decoder_layer_on(
    pool: &dyn ForkJoin,
    x: &mut [f32],
    w: &LayerWeights<'_>,
    heads: &Heads,
    cache: PagedCacheMut<'_>,
    rows: &RowLayout<'_>,
    scale: f32,
) -> Result<(), LayerError> {
    let n = rows.slots.len();
    let hidden = w.input_norm.len();
    if x.len() != n * hidden {
        return Err(LayerError::Shape(format!("x: {} values for {n} rows of {hidden}", x.len())));
    }
    let mut normed = vec![0.0f32; n * hidden];
    rms_norm(x, w.input_norm, w.eps, &mut normed)?;
    layer_from_attention_input_on(pool, x, &normed, w, heads, cache, rows, scale)
}

/// The layer with its attention's input given: `x` (the residual stream, `[rows, post_norm]`)
/// becomes `x + o(attn(qkv(attention_input)))`, then that plus the MLP of its norm.
/// `decoder_layer_on` gives `norm(x)`; an EAGLE head gives `[norm(embedding), norm(hidden)]`
/// (its qkv takes twice the hidden size, and `input_norm` is then the embedding's norm).
#[allow(clippy::too_many_arguments)]
pub fn layer_from_attention_input_on(
    pool: &dyn ForkJoin,
    x: &mut [f32],
    attention_input: &[f32],
    w: &LayerWeights<'_>,
    heads: &Heads,
    cache: PagedCacheMut<'_>,
    rows: &RowLayout<'_>,
    scale: f32,
) -> Result<(), LayerError> {
    let hidden = w.post_norm.len();
    let n = rows.slots.len();
    let (qd, kvd) = (heads.q * heads.dim, heads.kv * heads.dim);
    let width = qd + 2 * kvd;
    if x.len() != n * hidden {
        return Err(LayerError::Shape(format!("x: {} values for {n} rows of {hidden}", x.len())));
    }
    if attention_input.len() != n * w.qkv.fan_in() {
        return Err(LayerError::Shape(format!(
            "attention input: {} values for {n} rows of qkv's {} inputs",
            attention_input.len(),
            w.qkv.fan_in()
        )));
    }
    if w.qkv.fan_out() != width {
        return Err(LayerError::Shape(format!("qkv: {} outputs, the heads need {width}", w.qkv.fan_out())));
    }
    let capacity = cache.keys.len() / kvd.max(1);
    if cache.values.len() != cache.keys.len()
        || !cache.keys.len().is_multiple_of((kvd * cache.block_size).max(1))
    {
        return Err(LayerError::Shape(format!(
            "k_cache and v_cache: {} and {} values, not whole blocks of {} x {kvd}",
            cache.keys.len(),
            cache.values.len(),
            cache.block_size
        )));
    }
    if let Some((row, &slot)) = rows.slots.iter().enumerate().find(|(_, &s)| s < 0 || s as usize >= capacity)
    {
        return Err(LayerError::SlotOutOfRange { row, slot, capacity });
    }

    let mut qkv = vec![0.0f32; n * width];
    project_on(pool, attention_input, &w.qkv, &mut qkv)?;
    rotary(&mut qkv, width, heads.q + heads.kv, heads.dim, rows.cos, rows.sin)?;
    let mut queries = vec![0.0f32; n * qd];
    for (r, row) in qkv.chunks_exact(width).enumerate() {
        let slot = rows.slots[r] as usize;
        cache.keys[slot * kvd..][..kvd].copy_from_slice(&row[qd..qd + kvd]);
        cache.values[slot * kvd..][..kvd].copy_from_slice(&row[qd + kvd..]);
        queries[r * qd..][..qd].copy_from_slice(&row[..qd]);
    }
    let paged = PagedCache {
        keys: cache.keys,
        values: cache.values,
        block_size: cache.block_size,
        num_kv_heads: heads.kv,
        head_dim: heads.dim,
    };
    let batch = DecodeBatch {
        queries: &queries,
        num_q_heads: heads.q,
        block_tables: rows.block_tables,
        table_width: rows.table_width,
        seq_lens: rows.seq_lens,
        masks: rows.masks,
    };
    let mut attended = vec![0.0f32; n * qd];
    decode_attention_on(pool, &paged, &batch, scale, &mut attended)?;
    let mut projected = vec![0.0f32; n * hidden];
    project_on(pool, &attended, &w.o, &mut projected)?;
    let mut h = vec![0.0f32; n * hidden];
    add_rms_norm(&projected, x, w.post_norm, w.eps, &mut h)?;
    let inner = w.down.fan_in();
    let mut gate_up = vec![0.0f32; n * 2 * inner];
    project_on(pool, &h, &w.gate_up, &mut gate_up)?;
    let mut act = vec![0.0f32; n * inner];
    silu_mul(&gate_up, &mut act, inner)?;
    project_on(pool, &act, &w.down, &mut projected)?;
    for (x, d) in x.iter_mut().zip(&projected) {
        *x += d;
    }
    Ok(())
}
