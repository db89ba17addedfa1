//! Greedy decoding of a whole Llama-family model, several tokens ahead, in one call: what a
//! draft model does between two target steps. Each forward is the embedding lookup, every
//! `decoder_layer_on`, the final RMSNorm and the head (`project_on`), and the next token is the
//! head's argmax (the first index of the largest logit, as torch's `argmax`), with no interpreter
//! between forwards. The ops are those the op-by-op path runs on a few rows, so a guess here is
//! the guess there, bit for bit.
//!
//! A call first feeds each request the tokens it has not computed yet (its `Feed` rows, in
//! position order; they may be several, and each attends to its own prefix), takes the argmax
//! after the request's last fed row as its first guess, then feeds that guess and takes the
//! next, `depth[r]` guesses in all. Every forward writes the keys and values of its rows into the
//! paged cache, so the cache ends holding the fed tokens and all but the last guess.

use crate::decoder_layer::{decoder_layer_on, Heads, LayerError, LayerWeights, PagedCacheMut, RowLayout};
use crate::layer_ops::rms_norm;
use crate::parallel::ForkJoin;
use crate::projection::{project_on, Projection};

/// The model's parameters: `embed` [vocab, hidden], the layers, the final norm, the head
/// [vocab, hidden] (often the embedding itself).
pub struct ModelWeights<'a> {
    pub embed: &'a [f32],
    pub layers: Vec<LayerWeights<'a>>,
    pub norm: &'a [f32],
    pub eps: f32,
    pub head: Projection<'a>,
}

/// Rotary tables by position: `cos`, `sin` [positions, head_dim].
pub struct RopeTables<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// The tokens to feed before guessing: row i is `tokens[i]` of request `requests[i]` at
/// `positions[i]`; a request's rows come in increasing positions.
pub struct Feed<'a> {
    pub tokens: &'a [i32],
    pub positions: &'a [i64],
    pub requests: &'a [usize],
}

/// The requests: their block tables ([requests, table_width]) and guesses wanted (`depth`).
pub struct Requests<'a> {
    pub block_tables: &'a [i32],
    pub table_width: usize,
    pub block_size: usize,
    pub depth: &'a [usize],
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
    requests: &Requests<'_>,
    scale: f32,
) -> Result<Vec<i32>, LayerError> {
    let hidden = model.norm.len();
    let vocab = model.head.fan_out();
    let num_requests = requests.depth.len();
    check(model, heads, caches, rope, feed, requests, hidden, vocab)?;
    let max_depth = requests.depth.iter().copied().max().unwrap_or(0);
    let mut guesses = vec![-1i32; num_requests * max_depth];
    // The rows of the next forward: (token, position, request).
    let mut rows: Vec<(i32, i64, usize)> =
        (0..feed.tokens.len()).map(|i| (feed.tokens[i], feed.positions[i], feed.requests[i])).collect();
    for j in 0..max_depth {
        let last = forward(pool, model, heads, caches, rope, requests, scale, &rows)?;
        let mut next = Vec::new();
        for (r, row) in last.of_request.iter().enumerate() {
            let Some((logits_row, position)) = *row else { continue };
            if requests.depth[r] <= j {
                continue;
            }
            let token = argmax(&last.logits[logits_row * vocab..][..vocab]) as i32;
            guesses[r * max_depth + j] = token;
            if requests.depth[r] > j + 1 {
                next.push((token, position + 1, r));
            }
        }
        if next.is_empty() {
            break;
        }
        rows = next;
    }
    if max_depth == 0 && !rows.is_empty() {
        forward(pool, model, heads, caches, rope, requests, scale, &rows)?;
    }
    Ok(guesses)
}

/// What a forward hands on: the logits after each request's last row, and per request where its
/// row of `logits` is and that row's position (None for a request with no row in the forward).
struct LastRows {
    logits: Vec<f32>,
    of_request: Vec<Option<(usize, i64)>>,
}

/// One forward over `rows`.
#[allow(clippy::too_many_arguments)]
fn forward(
    pool: &dyn ForkJoin,
    model: &ModelWeights<'_>,
    heads: &Heads,
    caches: &mut [(&mut [f32], &mut [f32])],
    rope: &RopeTables<'_>,
    requests: &Requests<'_>,
    scale: f32,
    rows: &[(i32, i64, usize)],
) -> Result<LastRows, LayerError> {
    let hidden = model.norm.len();
    let (dim, width, bs) = (heads.dim, requests.table_width, requests.block_size as i64);
    let n = rows.len();
    let mut x = Vec::with_capacity(n * hidden);
    let (mut slots, mut tables, mut seq_lens) =
        (Vec::with_capacity(n), Vec::with_capacity(n * width), Vec::with_capacity(n));
    let (mut cos, mut sin) = (Vec::with_capacity(n * dim), Vec::with_capacity(n * dim));
    for &(token, position, r) in rows {
        let t = token as usize;
        x.extend_from_slice(&model.embed[t * hidden..][..hidden]);
        let table = &requests.block_tables[r * width..][..width];
        let block = table[(position / bs) as usize] as i64;
        slots.push(block * bs + position % bs);
        tables.extend_from_slice(table);
        seq_lens.push(position as i32 + 1);
        let p = position as usize;
        cos.extend_from_slice(&rope.cos[p * dim..][..dim]);
        sin.extend_from_slice(&rope.sin[p * dim..][..dim]);
    }
    let layout = RowLayout {
        slots: &slots,
        block_tables: &tables,
        table_width: width,
        seq_lens: &seq_lens,
        cos: &cos,
        sin: &sin,
    };
    for (layer, (keys, values)) in model.layers.iter().zip(caches.iter_mut()) {
        let cache = PagedCacheMut { keys, values, block_size: requests.block_size };
        decoder_layer_on(pool, &mut x, layer, heads, cache, &layout, scale)?;
    }
    // Only each request's last row reaches the head.
    let mut last_row: Vec<Option<usize>> = vec![None; requests.depth.len()];
    for (i, &(_, _, r)) in rows.iter().enumerate() {
        last_row[r] = Some(i);
    }
    let picked: Vec<usize> = last_row.iter().flatten().copied().collect();
    let mut h = Vec::with_capacity(picked.len() * hidden);
    for &i in &picked {
        h.extend_from_slice(&x[i * hidden..][..hidden]);
    }
    let mut normed = vec![0.0f32; h.len()];
    rms_norm(&h, model.norm, model.eps, &mut normed)?;
    let vocab = model.head.fan_out();
    let mut logits = vec![0.0f32; picked.len() * vocab];
    project_on(pool, &normed, &model.head, &mut logits)?;
    let mut picked_index = 0;
    let of_request = last_row
        .iter()
        .map(|row| {
            row.map(|i| {
                picked_index += 1;
                (picked_index - 1, rows[i].1)
            })
        })
        .collect();
    Ok(LastRows { logits, of_request })
}

/// The index of the first largest value (NaN never wins).
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// Everything a forward indexes, checked before any forward runs: ids inside the vocabulary,
/// positions inside the rotary tables and the block tables, requests that exist and get rows.
#[allow(clippy::too_many_arguments)]
fn check(
    model: &ModelWeights<'_>,
    heads: &Heads,
    caches: &[(&mut [f32], &mut [f32])],
    rope: &RopeTables<'_>,
    feed: &Feed<'_>,
    requests: &Requests<'_>,
    hidden: usize,
    vocab: usize,
) -> Result<(), LayerError> {
    let shape = |m: String| Err(LayerError::Shape(m));
    if hidden == 0 || model.embed.len() % hidden != 0 || model.head.fan_in() != hidden {
        return shape(format!(
            "embed ({} values) and head ({} inputs) must have rows of the norm's {hidden}",
            model.embed.len(),
            model.head.fan_in()
        ));
    }
    let embed_rows = model.embed.len() / hidden;
    if caches.len() != model.layers.len() {
        return shape(format!("{} caches for {} layers", caches.len(), model.layers.len()));
    }
    let dim = heads.dim;
    if dim == 0 || rope.cos.len() != rope.sin.len() || rope.cos.len() % dim != 0 {
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
    let num_requests = requests.depth.len();
    if requests.block_size == 0 || requests.block_tables.len() != num_requests * requests.table_width {
        return shape(format!(
            "block_tables: {} values for {num_requests} requests of {}",
            requests.block_tables.len(),
            requests.table_width
        ));
    }
    let positions = (rope.cos.len() / dim) as i64;
    let covered = (requests.table_width * requests.block_size) as i64;
    let mut fed = vec![false; num_requests];
    for i in 0..n {
        let (token, position, r) = (feed.tokens[i], feed.positions[i], feed.requests[i]);
        if token < 0 || token as usize >= embed_rows.min(vocab) {
            return shape(format!(
                "feed row {i}: token {token} outside the vocabulary of {}",
                embed_rows.min(vocab)
            ));
        }
        if r >= num_requests {
            return shape(format!("feed row {i}: request {r} of {num_requests}"));
        }
        // The guesses go up to depth - 1 positions past the last fed row.
        let furthest = position + (requests.depth[r] as i64 - 1).max(0);
        if position < 0 || furthest >= positions.min(covered) {
            return shape(format!(
                "feed row {i}: position {position} (+ {} guesses) outside the {positions} rotary positions or the {covered} slots of its block table",
                requests.depth[r]
            ));
        }
        let table = &requests.block_tables[r * requests.table_width..][..requests.table_width];
        let bs = requests.block_size as i64;
        if let Some(p) = (position..=furthest).find(|p| table[(p / bs) as usize] <= 0) {
            return shape(format!("feed row {i}: position {p} has no block in request {r}'s table"));
        }
        fed[r] = true;
    }
    if let Some(r) = (0..num_requests).find(|&r| requests.depth[r] > 0 && !fed[r]) {
        return shape(format!("request {r} wants guesses but has no feed row"));
    }
    Ok(())
}
