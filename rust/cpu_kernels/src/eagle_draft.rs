//! An EAGLE-3 head's greedy drafting in one call, with no interpreter between its ops (what
//! `pyserve/speculative/eagle_head.py` runs op by op): it first feeds the head each request's
//! pairs not fed yet (the target's features at position p, fused by `fc`, with the token at
//! p + 1; a request's pairs in position order), takes the argmax of the head's logits after the
//! request's last pair as its first guess, then feeds that guess with the head's own output and
//! takes the next, `depth[r]` guesses in all. Every row's key and value go to the head's one-layer
//! paged cache.
//!
//! The head's layer is a decoder layer whose attention reads `[input_norm(embedding of the
//! token), hidden_norm(hidden)]` (its qkv takes twice the hidden size) and whose residual stream
//! is `hidden`; the guess is `target_ids[argmax(lm_head(norm(output)))]`.

use crate::decoder_layer::{layer_from_attention_input_on, Heads, LayerError, LayerWeights, PagedCacheMut};
use crate::layer_ops::rms_norm;
use crate::parallel::ForkJoin;
use crate::projection::{project_on, Projection};
use crate::whole_model::{
    argmax, check_rows, guessing_rows, BlockTables, Embedding, Feed, Layout, RopeTables,
};

/// The head's parameters. `layer.input_norm` normalizes the token's embedding; `lm_head` is
/// `[draft vocab, hidden]` and `target_ids[d]` the target's token of draft id d.
pub struct HeadWeights<'a> {
    pub fc: Projection<'a>,
    pub embed: Embedding<'a>,
    pub hidden_norm: &'a [f32],
    pub layer: LayerWeights<'a>,
    pub norm: &'a [f32],
    pub lm_head: Projection<'a>,
    pub target_ids: &'a [i64],
}

/// The pairs fed: row i is `feed`'s row i (request, position, the token after the position) with
/// the target's features there, `features[i]` (`fc`'s inputs wide).
pub struct Pairs<'a> {
    pub features: &'a [f32],
    pub feed: Feed<'a>,
}

/// Feeds the pairs, then guesses; returns the guesses (target ids), `depth.max()` a request,
/// row-major (request r's first `depth[r]` are its guesses, the rest -1). `cache` is the head's
/// (keys, values), `[num_blocks, block_size, kv heads, dim]` each.
#[allow(clippy::too_many_arguments)]
pub fn eagle_greedy_on(
    pool: &dyn ForkJoin,
    head: &HeadWeights<'_>,
    heads: &Heads,
    cache: (&mut [f32], &mut [f32]),
    rope: &RopeTables<'_>,
    pairs: &Pairs<'_>,
    tables: &BlockTables<'_>,
    depth: &[usize],
    scale: f32,
) -> Result<Vec<i32>, LayerError> {
    let num_requests = depth.len();
    if tables.requests() != num_requests {
        return Err(LayerError::Shape(format!(
            "depth: {num_requests} requests, the block tables have {}",
            tables.requests()
        )));
    }
    let vocab = check_head(head)?;
    check_rows(vocab, heads.dim, rope, &pairs.feed, tables, depth)?;
    let n = pairs.feed.tokens.len();
    if pairs.features.len() != n * head.fc.fan_in() {
        return Err(LayerError::Shape(format!(
            "features: {} values for {n} rows of fc's {} inputs",
            pairs.features.len(),
            head.fc.fan_in()
        )));
    }
    let hidden = head.norm.len();
    let (keys, values) = cache;
    let mut cache = (keys, values, tables.block_size);
    let max_depth = depth.iter().copied().max().unwrap_or(0);
    let mut guesses = vec![-1i32; num_requests * max_depth];
    let mut rows = pairs.feed.rows();
    let mut x = vec![0.0f32; n * hidden];
    project_on(pool, pairs.features, &head.fc, &mut x)?;
    if max_depth == 0 {
        return head_layer(pool, head, heads, &mut cache, rope, tables, scale, &rows, &mut x)
            .map(|_| guesses);
    }
    for j in 0..max_depth {
        head_layer(pool, head, heads, &mut cache, rope, tables, scale, &rows, &mut x)?;
        let guessing = guessing_rows(&rows, depth, j);
        let mut outputs = Vec::with_capacity(guessing.len() * hidden);
        for &(_, i) in &guessing {
            outputs.extend_from_slice(&x[i * hidden..][..hidden]);
        }
        let mut normed = vec![0.0f32; outputs.len()];
        rms_norm(&outputs, head.norm, head.layer.eps, &mut normed)?;
        let draft_vocab = head.lm_head.fan_out();
        let mut logits = vec![0.0f32; guessing.len() * draft_vocab];
        project_on(pool, &normed, &head.lm_head, &mut logits)?;
        let (mut next, mut next_x) = (Vec::new(), Vec::new());
        for (g, &(r, i)) in guessing.iter().enumerate() {
            let token = head.target_ids[argmax(&logits[g * draft_vocab..][..draft_vocab])] as i32;
            guesses[r * max_depth + j] = token;
            if depth[r] > j + 1 {
                next.push((token, rows[i].1 + 1, r));
                next_x.extend_from_slice(&outputs[g * hidden..][..hidden]);
            }
        }
        if next.is_empty() {
            break;
        }
        (rows, x) = (next, next_x);
    }
    Ok(guesses)
}

/// The head's layer over `rows` (token, position, request) whose hidden states are `x`
/// (`[rows, hidden]`), which become the layer's outputs.
#[allow(clippy::too_many_arguments)]
fn head_layer(
    pool: &dyn ForkJoin,
    head: &HeadWeights<'_>,
    heads: &Heads,
    cache: &mut (&mut [f32], &mut [f32], usize),
    rope: &RopeTables<'_>,
    tables: &BlockTables<'_>,
    scale: f32,
    rows: &[(i32, i64, usize)],
    x: &mut [f32],
) -> Result<(), LayerError> {
    let hidden = head.norm.len();
    let n = rows.len();
    let mut embedded = Vec::with_capacity(n * hidden);
    for &(token, _, _) in rows {
        head.embed.push_row(token as usize, hidden, &mut embedded);
    }
    let (mut e, mut h) = (vec![0.0f32; n * hidden], vec![0.0f32; n * hidden]);
    rms_norm(&embedded, head.layer.input_norm, head.layer.eps, &mut e)?;
    rms_norm(x, head.hidden_norm, head.layer.eps, &mut h)?;
    let mut input = Vec::with_capacity(2 * n * hidden);
    for (e, h) in e.chunks_exact(hidden).zip(h.chunks_exact(hidden)) {
        input.extend_from_slice(e);
        input.extend_from_slice(h);
    }
    let layout = Layout::of(rows, tables, rope, heads.dim);
    let paged = PagedCacheMut { keys: cache.0, values: cache.1, block_size: cache.2 };
    layer_from_attention_input_on(pool, x, &input, &head.layer, heads, paged, &layout.view(), scale)
}

/// The head's shapes agree with each other; returns the vocabulary a fed token is checked
/// against (the embedding's rows), every `target_ids` value inside it.
fn check_head(head: &HeadWeights<'_>) -> Result<usize, LayerError> {
    let shape = |m: String| Err(LayerError::Shape(m));
    let hidden = head.norm.len();
    let sizes = [
        ("fc's outputs", head.fc.fan_out()),
        ("hidden_norm", head.hidden_norm.len()),
        ("input_norm", head.layer.input_norm.len()),
        ("post_norm", head.layer.post_norm.len()),
        ("lm_head's inputs", head.lm_head.fan_in()),
        ("qkv's inputs / 2", head.layer.qkv.fan_in() / 2),
    ];
    if let Some((name, size)) = sizes.iter().find(|(_, size)| *size != hidden) {
        return shape(format!("{name}: {size}, the norm's hidden size is {hidden}"));
    }
    if head.layer.qkv.fan_in() != 2 * hidden {
        return shape(format!("qkv: {} inputs, not twice the hidden size {hidden}", head.layer.qkv.fan_in()));
    }
    if head.target_ids.len() != head.lm_head.fan_out() {
        return shape(format!(
            "target_ids: {} ids for lm_head's {} outputs",
            head.target_ids.len(),
            head.lm_head.fan_out()
        ));
    }
    let Some(vocab) = (hidden > 0).then(|| head.embed.rows(hidden)).flatten() else {
        return shape(format!("embed: not rows of the hidden size {hidden}"));
    };
    if let Some(&id) = head.target_ids.iter().find(|&&id| id < 0 || id as usize >= vocab) {
        return shape(format!("target_ids: {id} outside the embedding's {vocab} tokens"));
    }
    Ok(vocab)
}
