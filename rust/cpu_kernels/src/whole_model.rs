//! A whole Llama-family model over a few rows in one call, with no interpreter between its ops:
//! the embedding lookup, every `decoder_layer_on`, the final RMSNorm and the head (`project_on`).
//! The ops are those the op-by-op path runs on a few rows, so the logits have its bits.
//!
//! - `model_forward_on`: one forward, the logits of chosen rows (a decode or verification step),
//!   and, where asked, the residual stream entering chosen layers (what an EAGLE head reads).
//! - `greedy_decode_on`: what a draft model does between two target steps. It first feeds each
//!   request the tokens it has not computed yet (its `Feed` rows, in position order; they may be
//!   several, and each attends to its own prefix), takes the argmax after the request's last fed
//!   row (the first index of the largest logit, as torch's `argmax`) as its first guess, then
//!   feeds that guess and takes the next, `depth[r]` guesses in all.
//!
//! Every forward writes the keys and values of its rows into the paged cache.

use crate::decoder_layer::{decoder_layer_on, Heads, LayerError, LayerWeights, PagedCacheMut, RowLayout};
use crate::gguf_blocks::{widen_row, BlockKind};
use crate::layer_ops::rms_norm;
use crate::parallel::ForkJoin;
use crate::projection::{project_on, Projection};

/// The model's parameters: the embedding table, the layers, the final norm, the head
/// [vocab, hidden] (often the embedding itself).
pub struct ModelWeights<'a> {
    pub embed: Embedding<'a>,
    pub layers: Vec<LayerWeights<'a>>,
    pub norm: &'a [f32],
    pub eps: f32,
    pub head: Projection<'a>,
}

/// An embedding table: f32 [vocab, hidden], or a GGUF file's blocks [vocab, row bytes] of `kind`,
/// each row looked up widened with gguf's arithmetic (`gguf_blocks::widen`).
pub enum Embedding<'a> {
    F32(&'a [f32]),
    Blocks { kind: BlockKind, blocks: &'a [u8] },
}

impl Embedding<'_> {
    /// Rows of `hidden` values it holds (None: not a whole number of them).
    pub(crate) fn rows(&self, hidden: usize) -> Option<usize> {
        match self {
            Embedding::F32(t) => t.len().is_multiple_of(hidden).then(|| t.len() / hidden),
            Embedding::Blocks { kind, blocks } => {
                let row_bytes = kind.row_bytes(hidden)?;
                blocks.len().is_multiple_of(row_bytes).then(|| blocks.len() / row_bytes)
            }
        }
    }

    /// Appends row t (checked to be one of its rows) to x.
    pub(crate) fn push_row(&self, t: usize, hidden: usize, x: &mut Vec<f32>) {
        match self {
            Embedding::F32(table) => x.extend_from_slice(&table[t * hidden..][..hidden]),
            Embedding::Blocks { kind, blocks } => {
                let row_bytes = kind.row_bytes(hidden).unwrap_or(0); // `rows` checked it
                let start = x.len();
                x.resize(start + hidden, 0.0);
                widen_row(*kind, &blocks[t * row_bytes..][..row_bytes], &mut x[start..]);
            }
        }
    }
}

/// Rotary tables by position: `cos`, `sin` [positions, head_dim].
pub struct RopeTables<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// The rows of a forward: row i is `tokens[i]` of request `requests[i]` at `positions[i]`; a
/// request's rows come in increasing positions.
pub struct Feed<'a> {
    pub tokens: &'a [i32],
    pub positions: &'a [i64],
    pub requests: &'a [usize],
}

impl Feed<'_> {
    /// (token, position, request) of each row.
    pub(crate) fn rows(&self) -> Vec<(i32, i64, usize)> {
        (0..self.tokens.len()).map(|i| (self.tokens[i], self.positions[i], self.requests[i])).collect()
    }
}

/// The requests' block tables: `[requests, width]`, of blocks of `block_size` slots (0: none).
pub struct BlockTables<'a> {
    pub tables: &'a [i32],
    pub width: usize,
    pub block_size: usize,
}

impl BlockTables<'_> {
    pub fn requests(&self) -> usize {
        self.tables.len() / self.width.max(1)
    }

    pub(crate) fn row(&self, r: usize) -> &[i32] {
        &self.tables[r * self.width..][..self.width]
    }
}

/// What one forward returns: the logits of the rows asked for (`[logits_rows, vocab]`,
/// row-major) and the residual stream entering each of `aux_layers`, side by side for every row
/// (`[rows, aux_layers.len() * hidden]`; empty when none was asked for).
pub struct ForwardOutput {
    pub logits: Vec<f32>,
    pub aux: Vec<f32>,
}

/// The logits of the rows `logits_rows` of `feed` after one forward over all of them, and the
/// inputs of the layers `aux_layers` (increasing). `caches` holds each layer's (keys, values),
/// `[num_blocks, block_size, kv heads, dim]` each.
#[allow(clippy::too_many_arguments)]
pub fn model_forward_on(
    pool: &dyn ForkJoin,
    model: &ModelWeights<'_>,
    heads: &Heads,
    caches: &mut [(&mut [f32], &mut [f32])],
    rope: &RopeTables<'_>,
    feed: &Feed<'_>,
    tables: &BlockTables<'_>,
    scale: f32,
    logits_rows: &[usize],
    aux_layers: &[usize],
) -> Result<ForwardOutput, LayerError> {
    check(model, heads, caches, rope, feed, tables, &vec![0; tables.requests()])?;
    if let Some(&row) = logits_rows.iter().find(|&&i| i >= feed.tokens.len()) {
        return Err(LayerError::Shape(format!("logits row {row} of {} rows", feed.tokens.len())));
    }
    if !aux_layers.windows(2).all(|w| w[0] < w[1]) || aux_layers.iter().any(|&l| l >= model.layers.len()) {
        return Err(LayerError::Shape(format!(
            "aux layers {aux_layers:?}: not increasing layers of the model's {}",
            model.layers.len()
        )));
    }
    forward(pool, model, heads, caches, rope, tables, scale, &feed.rows(), logits_rows, aux_layers)
}

/// Runs the feed and the guesses; returns the guesses, `depth.max()` a request, row-major
/// (request r's first `depth[r]` are its guesses, the rest -1). `caches` holds each layer's
/// (keys, values), `[num_blocks, block_size, kv heads, dim]` each.
#[allow(clippy::too_many_arguments)]
pub fn greedy_decode_on(
    pool: &dyn ForkJoin,
    model: &ModelWeights<'_>,
    heads: &Heads,
    caches: &mut [(&mut [f32], &mut [f32])],
    rope: &RopeTables<'_>,
    feed: &Feed<'_>,
    tables: &BlockTables<'_>,
    depth: &[usize],
    scale: f32,
) -> Result<Vec<i32>, LayerError> {
    let vocab = model.head.fan_out();
    let num_requests = depth.len();
    if tables.requests() != num_requests {
        return Err(LayerError::Shape(format!(
            "depth: {num_requests} requests, the block tables have {}",
            tables.requests()
        )));
    }
    check(model, heads, caches, rope, feed, tables, depth)?;
    let max_depth = depth.iter().copied().max().unwrap_or(0);
    let mut guesses = vec![-1i32; num_requests * max_depth];
    // The rows of the next forward: (token, position, request).
    let mut rows = feed.rows();
    for j in 0..max_depth {
        let guessing = guessing_rows(&rows, depth, j);
        let picked: Vec<usize> = guessing.iter().map(|&(_, i)| i).collect();
        let logits = forward(pool, model, heads, caches, rope, tables, scale, &rows, &picked, &[])?.logits;
        let mut next = Vec::new();
        for (n, &(r, i)) in guessing.iter().enumerate() {
            let token = argmax(&logits[n * vocab..][..vocab]) as i32;
            guesses[r * max_depth + j] = token;
            if depth[r] > j + 1 {
                next.push((token, rows[i].1 + 1, r));
            }
        }
        if next.is_empty() {
            break;
        }
        rows = next;
    }
    if max_depth == 0 && !rows.is_empty() {
        forward(pool, model, heads, caches, rope, tables, scale, &rows, &[], &[])?;
    }
    Ok(guesses)
}

/// One forward over `rows` (token, position, request); the logits of `logits_rows` and the
/// inputs of `aux_layers`.
#[allow(clippy::too_many_arguments)]
fn forward(
    pool: &dyn ForkJoin,
    model: &ModelWeights<'_>,
    heads: &Heads,
    caches: &mut [(&mut [f32], &mut [f32])],
    rope: &RopeTables<'_>,
    tables: &BlockTables<'_>,
    scale: f32,
    rows: &[(i32, i64, usize)],
    logits_rows: &[usize],
    aux_layers: &[usize],
) -> Result<ForwardOutput, LayerError> {
    let hidden = model.norm.len();
    let n = rows.len();
    let mut x = Vec::with_capacity(n * hidden);
    for &(token, _, _) in rows {
        model.embed.push_row(token as usize, hidden, &mut x);
    }
    let layout = Layout::of(rows, tables, rope, heads.dim);
    let layout = layout.view();
    let width_aux = aux_layers.len() * hidden;
    let mut aux = vec![0.0f32; n * width_aux];
    for (l, (layer, (keys, values))) in model.layers.iter().zip(caches.iter_mut()).enumerate() {
        if let Some(c) = aux_layers.iter().position(|&a| a == l) {
            for r in 0..n {
                aux[r * width_aux + c * hidden..][..hidden].copy_from_slice(&x[r * hidden..][..hidden]);
            }
        }
        let cache = PagedCacheMut { keys, values, block_size: tables.block_size };
        decoder_layer_on(pool, &mut x, layer, heads, cache, &layout, scale)?;
    }
    let mut h = Vec::with_capacity(logits_rows.len() * hidden);
    for &i in logits_rows {
        h.extend_from_slice(&x[i * hidden..][..hidden]);
    }
    let mut normed = vec![0.0f32; h.len()];
    rms_norm(&h, model.norm, model.eps, &mut normed)?;
    let mut logits = vec![0.0f32; logits_rows.len() * model.head.fan_out()];
    project_on(pool, &normed, &model.head, &mut logits)?;
    Ok(ForwardOutput { logits, aux })
}

/// Where rows (token, position, request) go in the paged cache and what they attend: each row's
/// slot, its request's block table, its length with itself and its rotary cos/sin.
pub(crate) struct Layout {
    slots: Vec<i64>,
    tables: Vec<i32>,
    width: usize,
    seq_lens: Vec<i32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Layout {
    /// The rows' layout; their positions are checked (`check_rows`) to have blocks and rotary rows.
    pub(crate) fn of(
        rows: &[(i32, i64, usize)],
        tables: &BlockTables<'_>,
        rope: &RopeTables<'_>,
        dim: usize,
    ) -> Self {
        let (n, width, bs) = (rows.len(), tables.width, tables.block_size as i64);
        let mut layout = Layout {
            slots: Vec::with_capacity(n),
            tables: Vec::with_capacity(n * width),
            width,
            seq_lens: Vec::with_capacity(n),
            cos: Vec::with_capacity(n * dim),
            sin: Vec::with_capacity(n * dim),
        };
        for &(_, position, r) in rows {
            let table = tables.row(r);
            let block = table[(position / bs) as usize] as i64;
            layout.slots.push(block * bs + position % bs);
            layout.tables.extend_from_slice(table);
            layout.seq_lens.push(position as i32 + 1);
            let p = position as usize;
            layout.cos.extend_from_slice(&rope.cos[p * dim..][..dim]);
            layout.sin.extend_from_slice(&rope.sin[p * dim..][..dim]);
        }
        layout
    }

    pub(crate) fn view(&self) -> RowLayout<'_> {
        RowLayout {
            slots: &self.slots,
            block_tables: &self.tables,
            table_width: self.width,
            seq_lens: &self.seq_lens,
            masks: None,
            cos: &self.cos,
            sin: &self.sin,
        }
    }
}

/// (request, row) of each request that makes its guess `j` (`depth[r] > j`) after this forward
/// of `rows` (token, position, request): the request's last row, which its guess follows (a
/// request's rows are in position order).
pub(crate) fn guessing_rows(rows: &[(i32, i64, usize)], depth: &[usize], j: usize) -> Vec<(usize, usize)> {
    let mut last_row: Vec<Option<usize>> = vec![None; depth.len()];
    for (i, &(_, _, r)) in rows.iter().enumerate() {
        last_row[r] = Some(i);
    }
    (0..depth.len()).filter(|&r| depth[r] > j).filter_map(|r| last_row[r].map(|i| (r, i))).collect()
}

/// The index of the first largest value (NaN never wins).
pub(crate) fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// Everything a forward indexes, checked before any forward runs: the model's shapes, then
/// `check_rows`.
fn check(
    model: &ModelWeights<'_>,
    heads: &Heads,
    caches: &[(&mut [f32], &mut [f32])],
    rope: &RopeTables<'_>,
    feed: &Feed<'_>,
    tables: &BlockTables<'_>,
    depth: &[usize],
) -> Result<(), LayerError> {
    let shape = |m: String| Err(LayerError::Shape(m));
    let (hidden, vocab) = (model.norm.len(), model.head.fan_out());
    let embed_rows = (hidden > 0).then(|| model.embed.rows(hidden)).flatten();
    let Some(embed_rows) = embed_rows.filter(|_| model.head.fan_in() == hidden) else {
        return shape(format!(
            "embed and head ({} inputs) must have rows of the norm's {hidden}",
            model.head.fan_in()
        ));
    };
    if caches.len() != model.layers.len() {
        return shape(format!("{} caches for {} layers", caches.len(), model.layers.len()));
    }
    check_rows(embed_rows.min(vocab), heads.dim, rope, feed, tables, depth)
}

/// The rows a forward indexes, checked before any forward runs: ids below `vocab`, positions
/// inside the rotary tables and the block tables (`depth[r] - 1` guesses past a row of request r
/// included), requests that exist, and a row for every request that guesses.
pub(crate) fn check_rows(
    vocab: usize,
    dim: usize,
    rope: &RopeTables<'_>,
    feed: &Feed<'_>,
    tables: &BlockTables<'_>,
    depth: &[usize],
) -> Result<(), LayerError> {
    let shape = |m: String| Err(LayerError::Shape(m));
    if dim == 0 || rope.cos.len() != rope.sin.len() || !rope.cos.len().is_multiple_of(dim) {
        return shape(format!(
            "cos and sin: {} and {} values, not rows of {dim}",
            rope.cos.len(),
            rope.sin.len()
        ));
    }
    let n = feed.tokens.len();
    if feed.positions.len() != n || feed.requests.len() != n {
        return shape(format!(
            "feed: {n} tokens, {} positions, {} requests",
            feed.positions.len(),
            feed.requests.len()
        ));
    }
    let num_requests = depth.len();
    if tables.block_size == 0 || tables.width == 0 || tables.tables.len() != num_requests * tables.width {
        return shape(format!(
            "block_tables: {} values for {num_requests} requests of {}",
            tables.tables.len(),
            tables.width
        ));
    }
    let positions = (rope.cos.len() / dim) as i64;
    let covered = (tables.width * tables.block_size) as i64;
    let bs = tables.block_size as i64;
    let mut fed = vec![false; num_requests];
    for i in 0..n {
        let (token, position, r) = (feed.tokens[i], feed.positions[i], feed.requests[i]);
        if token < 0 || token as usize >= vocab {
            return shape(format!("feed row {i}: token {token} outside the vocabulary of {vocab}"));
        }
        if r >= num_requests {
            return shape(format!("feed row {i}: request {r} of {num_requests}"));
        }
        let furthest = position + (depth[r] as i64 - 1).max(0);
        if position < 0 || furthest >= positions.min(covered) {
            return shape(format!(
                "feed row {i}: position {position} (+ {} guesses) outside the {positions} rotary positions or the {covered} slots of its block table",
                depth[r]
            ));
        }
        let table = tables.row(r);
        if let Some(p) = (position..=furthest).find(|p| table[(p / bs) as usize] <= 0) {
            return shape(format!("feed row {i}: position {p} has no block in request {r}'s table"));
        }
        fed[r] = true;
    }
    if let Some(r) = (0..num_requests).find(|&r| depth[r] > 0 && !fed[r]) {
        return shape(format!("request {r} wants guesses but has no feed row"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_blocks::widen;
    use crate::parallel::OnCallingThread;

    /// A row looked up from blocks is the row of the table `widen` makes of them, bit for bit.
    #[test]
    fn a_row_of_blocks_is_the_widened_tables_row() {
        let (rows, hidden) = (5, 64);
        for (kind, bytes) in [(BlockKind::Q8_0, 34), (BlockKind::Q4K, 144), (BlockKind::Q6K, 210)] {
            let weights = kind.weights_and_bytes().0;
            let hidden = hidden.max(weights);
            let n = rows * hidden / weights * bytes;
            let mut blocks: Vec<u8> = (0..n).map(|i| (i * 37 % 251) as u8).collect();
            // sensible f16 scales where each block keeps them (Q8_0, Q4_K: first; Q6_K: last)
            let at = if kind == BlockKind::Q6K { bytes - 2 } else { 0 };
            for block in blocks.chunks_exact_mut(bytes) {
                block[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
            let mut table = vec![0.0f32; rows * hidden];
            widen(&OnCallingThread, kind, &blocks, rows, hidden, &mut table).unwrap();
            let embedding = Embedding::Blocks { kind, blocks: &blocks };
            assert_eq!(embedding.rows(hidden), Some(rows));
            for t in [3, 0, 4] {
                let mut x = vec![1.5];
                embedding.push_row(t, hidden, &mut x);
                assert_eq!(x[0], 1.5);
                assert_eq!(x[1..], table[t * hidden..][..hidden], "{kind:?} row {t}");
            }
        }
    }
}
