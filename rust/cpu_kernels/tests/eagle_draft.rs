//! `eagle_greedy_on`: a lone pair's guess is the head's layer worked out by hand; feeding a
//! request's pairs over two calls guesses what one call does (the cache carries them); requests
//! side by side get their lone guesses (on one thread or two); bad inputs are refused before any write.

mod common;

use common::{Rng, ScopedThreads};
use pyserve_cpu_kernels::{
    eagle_greedy_on, BlockTables, Embedding, Feed, ForkJoin, HeadWeights, Heads, LayerError, LayerWeights,
    LinearWeights, OnCallingThread, Pairs, Projection, RopeTables,
};

const HIDDEN: usize = 16;
const FEATURES: usize = 3 * 12; // three layers of a target 12 wide
const VOCAB: usize = 40;
const DRAFT_VOCAB: usize = 24;
const HEADS: Heads = Heads { q: 2, kv: 1, dim: 8 };
const INNER: usize = 24;
const BLOCK: usize = 4;
const BLOCKS: usize = 16;
const POSITIONS: usize = 32;
const EPS: f32 = 1e-6;

struct Params {
    fc: Vec<f32>,
    embed: Vec<f32>,
    hidden_norm: Vec<f32>,
    input_norm: Vec<f32>,
    qkv: Vec<f32>,
    o: Vec<f32>,
    post_norm: Vec<f32>,
    gate_up: Vec<f32>,
    down: Vec<f32>,
    norm: Vec<f32>,
    lm_head: Vec<f32>,
    target_ids: Vec<i64>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

fn params() -> Params {
    let mut rng = Rng(11);
    let norm = |rng: &mut Rng| rng.vec(HIDDEN).iter().map(|v| 1.0 + 0.2 * v).collect::<Vec<f32>>();
    let angle = |p: usize, i: usize| p as f32 / 10f32.powf((i % (HEADS.dim / 2)) as f32 / 4.0);
    let table = |f: fn(f32) -> f32| {
        (0..POSITIONS).flat_map(|p| (0..HEADS.dim).map(move |i| f(angle(p, i)))).collect::<Vec<f32>>()
    };
    Params {
        fc: rng.vec(HIDDEN * FEATURES),
        embed: rng.vec(VOCAB * HIDDEN),
        hidden_norm: norm(&mut rng),
        input_norm: norm(&mut rng),
        qkv: rng.vec((HEADS.q + 2 * HEADS.kv) * HEADS.dim * 2 * HIDDEN),
        o: rng.vec(HIDDEN * HEADS.q * HEADS.dim),
        post_norm: norm(&mut rng),
        gate_up: rng.vec(2 * INNER * HIDDEN),
        down: rng.vec(HIDDEN * INNER),
        norm: norm(&mut rng),
        lm_head: rng.vec(DRAFT_VOCAB * HIDDEN),
        target_ids: (0..DRAFT_VOCAB as i64).map(|d| d + d % 5).collect(),
        cos: table(f32::cos),
        sin: table(f32::sin),
    }
}

fn linear(weight: &[f32], fan_in: usize) -> Projection<'_> {
    Projection::F32(LinearWeights { weight, bias: None, fan_in, fan_out: weight.len() / fan_in })
}

fn head(p: &Params) -> HeadWeights<'_> {
    HeadWeights {
        fc: linear(&p.fc, FEATURES),
        embed: Embedding::F32(&p.embed),
        hidden_norm: &p.hidden_norm,
        layer: LayerWeights {
            input_norm: &p.input_norm,
            qkv: linear(&p.qkv, 2 * HIDDEN),
            o: linear(&p.o, HEADS.q * HEADS.dim),
            post_norm: &p.post_norm,
            gate_up: linear(&p.gate_up, HIDDEN),
            down: linear(&p.down, INNER),
            eps: EPS,
        },
        norm: &p.norm,
        lm_head: linear(&p.lm_head, HIDDEN),
        target_ids: &p.target_ids,
    }
}

struct Cache(Vec<f32>, Vec<f32>);

impl Cache {
    fn new() -> Self {
        let size = BLOCKS * BLOCK * HEADS.kv * HEADS.dim;
        Cache(vec![0.0; size], vec![0.0; size])
    }
}

/// Request r owns blocks 1 + 4r .. 5 + 4r.
fn tables(requests: usize) -> Vec<i32> {
    (0..requests).flat_map(|r| (0..4).map(move |b| (1 + 4 * r + b) as i32)).collect()
}

fn draft(
    w: &HeadWeights<'_>,
    p: &Params,
    cache: &mut Cache,
    features: &[f32],
    rows: (&[i32], &[i64], &[usize]),
    depth: &[usize],
) -> Result<Vec<i32>, LayerError> {
    draft_on(&OnCallingThread, w, p, cache, features, rows, depth)
}

fn draft_on(
    pool: &dyn ForkJoin,
    w: &HeadWeights<'_>,
    p: &Params,
    cache: &mut Cache,
    features: &[f32],
    rows: (&[i32], &[i64], &[usize]),
    depth: &[usize],
) -> Result<Vec<i32>, LayerError> {
    let tables = tables(depth.len());
    let (tokens, positions, requests) = rows;
    eagle_greedy_on(
        pool,
        w,
        &HEADS,
        (&mut cache.0, &mut cache.1),
        &RopeTables { cos: &p.cos, sin: &p.sin },
        &Pairs { features, feed: Feed { tokens, positions, requests } },
        &BlockTables { tables: &tables, width: 4, block_size: BLOCK },
        depth,
        0.35,
    )
}

fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks_exact(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms(x: &[f32], w: &[f32]) -> Vec<f32> {
    let s = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + EPS).sqrt();
    x.iter().zip(w).map(|(v, w)| v * s * w).collect()
}

#[test]
fn a_lone_pairs_guess_is_the_layer_worked_by_hand() {
    // One row at position 0 attends to itself alone: each query head's output is its kv head's
    // value, whatever the rotation.
    let p = params();
    let features = Rng(5).vec(FEATURES);
    let token = 9;
    let x = matvec(&p.fc, &features);
    let input = [rms(&p.embed[token * HIDDEN..][..HIDDEN], &p.input_norm), rms(&x, &p.hidden_norm)].concat();
    let qkv = matvec(&p.qkv, &input);
    let value = &qkv[(HEADS.q + HEADS.kv) * HEADS.dim..];
    let attended: Vec<f32> = (0..HEADS.q).flat_map(|_| value.iter().copied()).collect();
    let h: Vec<f32> = x.iter().zip(matvec(&p.o, &attended)).map(|(a, b)| a + b).collect();
    let gate_up = matvec(&p.gate_up, &rms(&h, &p.post_norm));
    let act: Vec<f32> =
        (0..INNER).map(|i| gate_up[i] / (1.0 + (-gate_up[i]).exp()) * gate_up[INNER + i]).collect();
    let out: Vec<f32> = h.iter().zip(matvec(&p.down, &act)).map(|(a, b)| a + b).collect();
    let logits = matvec(&p.lm_head, &rms(&out, &p.norm));
    let best = (0..DRAFT_VOCAB).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });

    let mut cache = Cache::new();
    let guesses = draft(&head(&p), &p, &mut cache, &features, (&[token as i32], &[0], &[0]), &[1]).unwrap();
    assert_eq!(guesses, [p.target_ids[best] as i32]);
    let slot = BLOCK * HEADS.kv * HEADS.dim; // block 1, slot 0
    for (i, &v) in value.iter().enumerate() {
        assert!((cache.1[slot + i] - v).abs() < 1e-5, "value {i}");
    }
}

#[test]
fn pairs_fed_over_two_calls_guess_what_one_call_does() {
    let p = params();
    let w = head(&p);
    let features = Rng(3).vec(5 * FEATURES);
    let (tokens, positions) = ([3, 17, 5, 29, 11], [0, 1, 2, 3, 4]);
    let mut once = Cache::new();
    let all = draft(&w, &p, &mut once, &features, (&tokens, &positions, &[0; 5]), &[4]).unwrap();
    assert_eq!(all.len(), 4);
    assert!(all.iter().all(|&t| p.target_ids.contains(&(t as i64))));

    let mut split = Cache::new();
    let none =
        draft(&w, &p, &mut split, &features[..3 * FEATURES], (&tokens[..3], &positions[..3], &[0; 3]), &[0]);
    assert_eq!(none.unwrap(), Vec::<i32>::new());
    let rest =
        draft(&w, &p, &mut split, &features[3 * FEATURES..], (&tokens[3..], &positions[3..], &[0; 2]), &[4]);
    assert_eq!(rest.unwrap(), all);
    // Five pairs and three fed guesses written alike; the last guess was never fed.
    let (offset, written) = (BLOCK * HEADS.kv * HEADS.dim, 8 * HEADS.kv * HEADS.dim);
    assert_eq!(once.0[offset..][..written], split.0[offset..][..written]);
    assert_eq!(once.1[offset..][..written], split.1[offset..][..written]);
    assert!(once.0[offset + written..].iter().all(|&v| v == 0.0));
}

#[test]
fn requests_side_by_side_get_their_lone_guesses() {
    let p = params();
    let w = head(&p);
    let (fa, fb) = (Rng(21).vec(3 * FEATURES), Rng(22).vec(2 * FEATURES));
    let alone_a = draft(&w, &p, &mut Cache::new(), &fa, (&[3, 17, 5], &[0, 1, 2], &[0; 3]), &[3]).unwrap();
    let alone_b = draft(&w, &p, &mut Cache::new(), &fb, (&[8, 2], &[4, 5], &[0; 2]), &[1]).unwrap();
    let features = [fb.as_slice(), fa.as_slice()].concat();
    let rows = (&[8, 2, 3, 17, 5][..], &[4, 5, 0, 1, 2][..], &[0, 0, 1, 1, 1][..]);
    let both = draft(&w, &p, &mut Cache::new(), &features, rows, &[1, 3]).unwrap();
    assert_eq!(both, [alone_b[0], -1, -1, alone_a[0], alone_a[1], alone_a[2]]);
    let two_threads = draft_on(&ScopedThreads::new(2), &w, &p, &mut Cache::new(), &features, rows, &[1, 3]);
    assert_eq!(two_threads.unwrap(), both);
}

#[test]
fn bad_inputs_are_refused_before_any_write() {
    let p = params();
    let w = head(&p);
    let mut cache = Cache::new();
    let f = Rng(1).vec(FEATURES);
    let err = |r: Result<Vec<i32>, LayerError>| r.unwrap_err().to_string();
    assert!(err(draft(&w, &p, &mut cache, &f[1..], (&[1], &[0], &[0]), &[1])).contains("features"));
    assert!(err(draft(&w, &p, &mut cache, &f, (&[VOCAB as i32], &[0], &[0]), &[1]))
        .contains("outside the vocabulary"));
    assert!(err(draft(&w, &p, &mut cache, &f, (&[1], &[14], &[0]), &[4])).contains("outside"));
    let mut bad_ids = params();
    bad_ids.target_ids[3] = VOCAB as i64;
    assert!(err(draft(&head(&bad_ids), &p, &mut cache, &f, (&[1], &[0], &[0]), &[1])).contains("target_ids"));
    let mut narrow = head(&p);
    narrow.layer.qkv = linear(&p.qkv, HIDDEN);
    assert!(err(draft(&narrow, &p, &mut cache, &f, (&[1], &[0], &[0]), &[1])).contains("qkv"));
    assert!(cache.0.iter().chain(&cache.1).all(|&x| x == 0.0));
}
