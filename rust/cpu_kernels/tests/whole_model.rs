//! `greedy_decode_on`: guessing several tokens in one call equals guessing one at a time and
//! feeding each guess back (the cache carries the state between calls), rows of different
//! requests do not change each other's guesses, and bad inputs are refused before any write.
//! `model_forward_on`: its logits are those `greedy_decode_on` takes the argmax of.

mod common;

use common::{Rng, ScopedThreads};
use pyserve_cpu_kernels::{
    greedy_decode_on, model_forward_on, BlockTables, Embedding, Feed, ForkJoin, Heads, LayerError,
    LayerWeights, LinearWeights, ModelWeights, OnCallingThread, Projection, RopeTables,
};

const HIDDEN: usize = 16;
const VOCAB: usize = 40;
const HEADS: Heads = Heads { q: 2, kv: 1, dim: 8 };
const INNER: usize = 24;
const BLOCK: usize = 4;
const BLOCKS: usize = 16;
const POSITIONS: usize = 32;

struct Params {
    embed: Vec<f32>,
    layers: Vec<[Vec<f32>; 6]>, // input norm, qkv, o, post norm, gate_up, down
    norm: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

fn params() -> Params {
    let mut rng = Rng(7);
    let qkv = (HEADS.q + 2 * HEADS.kv) * HEADS.dim;
    let layers = (0..2)
        .map(|_| {
            [
                rng.vec(HIDDEN).iter().map(|v| 1.0 + 0.1 * v).collect(),
                rng.vec(qkv * HIDDEN),
                rng.vec(HIDDEN * HEADS.q * HEADS.dim),
                rng.vec(HIDDEN).iter().map(|v| 1.0 + 0.1 * v).collect(),
                rng.vec(2 * INNER * HIDDEN),
                rng.vec(HIDDEN * INNER),
            ]
        })
        .collect();
    let angle = |p: usize, i: usize| p as f32 / 10f32.powf((i % (HEADS.dim / 2)) as f32 / 4.0);
    let table = |f: fn(f32) -> f32| {
        (0..POSITIONS).flat_map(|p| (0..HEADS.dim).map(move |i| f(angle(p, i)))).collect::<Vec<f32>>()
    };
    Params {
        embed: rng.vec(VOCAB * HIDDEN),
        layers,
        norm: vec![1.0; HIDDEN],
        cos: table(f32::cos),
        sin: table(f32::sin),
    }
}

fn linear(weight: &[f32], fan_in: usize) -> Projection<'_> {
    Projection::F32(LinearWeights { weight, bias: None, fan_in, fan_out: weight.len() / fan_in })
}

fn model(p: &Params) -> ModelWeights<'_> {
    let layers = p
        .layers
        .iter()
        .map(|[input_norm, qkv, o, post_norm, gate_up, down]| LayerWeights {
            input_norm,
            qkv: linear(qkv, HIDDEN),
            o: linear(o, HEADS.q * HEADS.dim),
            post_norm,
            gate_up: linear(gate_up, HIDDEN),
            down: linear(down, INNER),
            eps: 1e-6,
        })
        .collect();
    ModelWeights {
        embed: Embedding::F32(&p.embed),
        layers,
        norm: &p.norm,
        eps: 1e-6,
        head: linear(&p.embed, HIDDEN),
    }
}

struct Cache(Vec<(Vec<f32>, Vec<f32>)>);

impl Cache {
    fn new() -> Self {
        let size = BLOCKS * BLOCK * HEADS.kv * HEADS.dim;
        Cache((0..2).map(|_| (vec![0.0; size], vec![0.0; size])).collect())
    }

    #[allow(clippy::type_complexity)]
    fn views(&mut self) -> Vec<(&mut [f32], &mut [f32])> {
        self.0.iter_mut().map(|(k, v)| (k.as_mut_slice(), v.as_mut_slice())).collect()
    }
}

/// Request r owns blocks 1 + 4r .. 5 + 4r.
fn tables(requests: usize) -> Vec<i32> {
    (0..requests).flat_map(|r| (0..4).map(move |b| (1 + 4 * r + b) as i32)).collect()
}

fn decode(
    p: &Params,
    cache: &mut Cache,
    tokens: &[i32],
    positions: &[i64],
    requests: &[usize],
    depth: &[usize],
) -> Result<Vec<i32>, LayerError> {
    decode_on(&OnCallingThread, p, cache, tokens, positions, requests, depth)
}

fn decode_on(
    pool: &dyn ForkJoin,
    p: &Params,
    cache: &mut Cache,
    tokens: &[i32],
    positions: &[i64],
    requests: &[usize],
    depth: &[usize],
) -> Result<Vec<i32>, LayerError> {
    let tables = tables(depth.len());
    greedy_decode_on(
        pool,
        &model(p),
        &HEADS,
        &mut cache.views(),
        &RopeTables { cos: &p.cos, sin: &p.sin },
        &Feed { tokens, positions, requests },
        &BlockTables { tables: &tables, width: 4, block_size: BLOCK },
        depth,
        0.35,
    )
}

#[test]
fn several_guesses_in_one_call_equal_one_guess_a_call() {
    let p = params();
    let prompt = [3, 17, 5, 29, 11];
    let positions: Vec<i64> = (0..5).collect();
    let mut once = Cache::new();
    let all = decode(&p, &mut once, &prompt, &positions, &[0; 5], &[6]).unwrap();
    assert_eq!(all.len(), 6);
    assert!(all.iter().all(|&t| (0..VOCAB as i32).contains(&t)));

    let mut stepwise = Cache::new();
    let mut guesses = decode(&p, &mut stepwise, &prompt, &positions, &[0; 5], &[1]).unwrap();
    for j in 1..6 {
        let last = *guesses.last().unwrap();
        guesses.extend(decode(&p, &mut stepwise, &[last], &[4 + j as i64], &[0], &[1]).unwrap());
    }
    assert_eq!(guesses, all);
    // The cache holds the prompt and the five fed guesses; the last guess was never fed.
    let written = 10 * HEADS.kv * HEADS.dim;
    let offset = BLOCK * HEADS.kv * HEADS.dim; // request 0's first block is block 1
    for ((k1, v1), (k2, v2)) in once.0.iter().zip(&stepwise.0) {
        assert_eq!(k1[offset..][..written], k2[offset..][..written]);
        assert_eq!(v1[offset..][..written], v2[offset..][..written]);
        assert!(k1[offset + written..].iter().all(|&v| v == 0.0));
    }
}

#[test]
fn requests_side_by_side_get_their_lone_guesses() {
    let p = params();
    let (a, b) = ([3, 17, 5], [8, 2, 30, 30, 1]);
    let alone_a = decode(&p, &mut Cache::new(), &a, &[0, 1, 2], &[0; 3], &[4]).unwrap();
    let alone_b = decode(&p, &mut Cache::new(), &b, &[0, 1, 2, 3, 4], &[0; 5], &[2]).unwrap();
    // Rows of b first, then a's; b wants fewer guesses, so the result pads it with -1.
    let tokens = [b.as_slice(), a.as_slice()].concat();
    let both =
        decode(&p, &mut Cache::new(), &tokens, &[0, 1, 2, 3, 4, 0, 1, 2], &[0, 0, 0, 0, 0, 1, 1, 1], &[2, 4])
            .unwrap();
    assert_eq!(both[..4], [alone_b[0], alone_b[1], -1, -1]);
    assert_eq!(both[4..], alone_a[..]);
}

#[test]
fn the_forward_gives_the_logits_whose_argmax_is_the_guess() {
    let p = params();
    let (tokens, positions) = ([3, 17, 5, 29, 8, 2], [0, 1, 2, 3, 0, 1]);
    let requests = [0, 0, 0, 0, 1, 1];
    let guesses = decode(&p, &mut Cache::new(), &tokens, &positions, &requests, &[1, 1]).unwrap();
    let tables = tables(2);
    let logits = model_forward_on(
        &OnCallingThread,
        &model(&p),
        &HEADS,
        &mut Cache::new().views(),
        &RopeTables { cos: &p.cos, sin: &p.sin },
        &Feed { tokens: &tokens, positions: &positions, requests: &requests },
        &BlockTables { tables: &tables, width: 4, block_size: BLOCK },
        0.35,
        &[3, 5, 0],
        &[],
    )
    .unwrap();
    assert!(logits.aux.is_empty());
    let logits = logits.logits;
    assert_eq!(logits.len(), 3 * VOCAB);
    let argmax = |row: &[f32]| (0..VOCAB).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as i32;
    assert_eq!([argmax(&logits[..VOCAB]), argmax(&logits[VOCAB..2 * VOCAB])], [guesses[0], guesses[1]]);
    assert!(logits[2 * VOCAB..].iter().all(|v| v.is_finite()));
}

#[test]
fn the_forward_keeps_the_inputs_of_the_layers_asked_for() {
    // A third layer after the model's two: its input is what the two-layer model's final norm
    // and head read, and the input of layer 0 is the embedding.
    let p = params();
    let (tokens, positions, requests) = ([3, 17, 5], [0, 1, 2], [0, 0, 0]);
    let tables = tables(1);
    let run = |weights: &ModelWeights<'_>, cache: &mut Vec<(Vec<f32>, Vec<f32>)>, aux: &[usize]| {
        let mut views: Vec<(&mut [f32], &mut [f32])> =
            cache.iter_mut().map(|(k, v)| (k.as_mut_slice(), v.as_mut_slice())).collect();
        model_forward_on(
            &OnCallingThread,
            weights,
            &HEADS,
            &mut views,
            &RopeTables { cos: &p.cos, sin: &p.sin },
            &Feed { tokens: &tokens, positions: &positions, requests: &requests },
            &BlockTables { tables: &tables, width: 4, block_size: BLOCK },
            0.35,
            &[0, 1, 2],
            aux,
        )
    };
    let size = BLOCKS * BLOCK * HEADS.kv * HEADS.dim;
    let two = model(&p);
    let logits =
        run(&two, &mut (0..2).map(|_| (vec![0.0; size], vec![0.0; size])).collect(), &[]).unwrap().logits;
    let mut three = model(&p);
    three.layers.push(model(&p).layers.remove(0));
    let out =
        run(&three, &mut (0..3).map(|_| (vec![0.0; size], vec![0.0; size])).collect(), &[0, 2]).unwrap();
    assert_eq!(out.aux.len(), 3 * 2 * HIDDEN);
    for (r, &t) in tokens.iter().enumerate() {
        let row = &out.aux[r * 2 * HIDDEN..][..2 * HIDDEN];
        assert_eq!(row[..HIDDEN], p.embed[t as usize * HIDDEN..][..HIDDEN]);
        let x = &row[HIDDEN..];
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / HIDDEN as f32 + 1e-6).sqrt();
        for v in 0..VOCAB {
            let by_hand: f32 = (0..HIDDEN).map(|i| x[i] / rms * p.embed[v * HIDDEN + i]).sum();
            assert!((by_hand - logits[r * VOCAB + v]).abs() < 1e-4, "row {r} token {v}");
        }
    }
    let refused = run(&three, &mut (0..3).map(|_| (vec![0.0; size], vec![0.0; size])).collect(), &[2, 1]);
    assert!(matches!(refused, Err(LayerError::Shape(m)) if m.contains("not increasing")));
}

#[test]
fn guesses_on_two_threads_equal_those_on_one() {
    let p = params();
    let (tokens, positions) = ([3, 17, 5, 8, 2], [0, 1, 2, 0, 1]);
    let one = decode(&p, &mut Cache::new(), &tokens, &positions, &[0, 0, 0, 1, 1], &[5, 3]).unwrap();
    let pool = ScopedThreads::new(2);
    let two =
        decode_on(&pool, &p, &mut Cache::new(), &tokens, &positions, &[0, 0, 0, 1, 1], &[5, 3]).unwrap();
    assert_eq!(one, two);
}

#[test]
fn bad_inputs_are_refused_before_any_write() {
    let p = params();
    let mut cache = Cache::new();
    let err = |r: Result<Vec<i32>, LayerError>| r.unwrap_err().to_string();
    assert!(err(decode(&p, &mut cache, &[VOCAB as i32], &[0], &[0], &[1])).contains("outside the vocabulary"));
    // Four blocks of four: the guesses of a row at position 14 would be fed at 15, 16 and 17.
    assert!(err(decode(&p, &mut cache, &[1], &[14], &[0], &[4])).contains("outside"));
    assert!(err(decode(&p, &mut cache, &[1], &[0], &[0], &[1, 1])).contains("no feed row"));
    assert!(err(decode(&p, &mut cache, &[1], &[0], &[2], &[1])).contains("request 2 of 1"));
    assert!(cache.0.iter().all(|(k, v)| k.iter().chain(v).all(|&x| x == 0.0)));
}
