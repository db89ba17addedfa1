//! The kernel against attention computed densely in f64 from the same rows.

mod common;

use common::{Rng, ScopedThreads};
use pyserve_cpu_kernels::{
    decode_attention, decode_attention_on, AttentionError, DecodeBatch, ForkJoin, PagedCache,
};

#[derive(Clone)]
struct Case {
    keys: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
    tables: Vec<i32>,
    lens: Vec<i32>,
    masks: Option<Vec<u64>>,
    width: usize,
    bs: usize,
    hkv: usize,
    hq: usize,
    d: usize,
}

fn case(lens: &[i32], bs: usize, hkv: usize, hq: usize, d: usize, seed: u64) -> Case {
    let mut rng = Rng(seed);
    let pages: Vec<usize> = lens.iter().map(|&n| (n as usize).div_ceil(bs)).collect();
    let width = pages.iter().copied().max().unwrap_or(0) + 1;
    let num_blocks = 1 + pages.iter().sum::<usize>();
    // Blocks handed out back to front, so no sequence's pages are adjacent in order.
    let mut free: Vec<i32> = (1..num_blocks as i32).collect();
    let mut tables = vec![0i32; lens.len() * width];
    for (s, &p) in pages.iter().enumerate() {
        for j in 0..p {
            tables[s * width + j] = free.pop().unwrap();
        }
    }
    let row = bs * hkv * d;
    Case {
        keys: rng.vec(num_blocks * row),
        values: rng.vec(num_blocks * row),
        queries: rng.vec(lens.len() * hq * d),
        tables,
        lens: lens.to_vec(),
        masks: None,
        width,
        bs,
        hkv,
        hq,
        d,
    }
}

fn run(c: &Case, scale: f32) -> Result<Vec<f32>, AttentionError> {
    run_on(None, c, scale)
}

fn run_on(pool: Option<&dyn ForkJoin>, c: &Case, scale: f32) -> Result<Vec<f32>, AttentionError> {
    let cache =
        PagedCache { keys: &c.keys, values: &c.values, block_size: c.bs, num_kv_heads: c.hkv, head_dim: c.d };
    let batch = DecodeBatch {
        queries: &c.queries,
        num_q_heads: c.hq,
        block_tables: &c.tables,
        table_width: c.width,
        seq_lens: &c.lens,
        masks: c.masks.as_deref(),
    };
    let mut out = vec![f32::NAN; c.queries.len()];
    match pool {
        Some(pool) => decode_attention_on(pool, &cache, &batch, scale, &mut out)?,
        None => decode_attention(&cache, &batch, scale, &mut out)?,
    }
    Ok(out)
}

fn dense(c: &Case, scale: f32) -> Vec<f64> {
    let mut out = vec![0.0; c.queries.len()];
    for (s, &len) in c.lens.iter().enumerate() {
        for qh in 0..c.hq {
            let h = qh / (c.hq / c.hkv);
            let q = &c.queries[(s * c.hq + qh) * c.d..][..c.d];
            let row = |t: usize| {
                let block = c.tables[s * c.width + t / c.bs] as usize;
                ((block * c.bs + t % c.bs) * c.hkv + h) * c.d
            };
            let mask = c.masks.as_ref().map_or(u64::MAX, |m| m[s]);
            let seen = |t: usize| len as usize - 1 - t >= 64 || mask >> (len as usize - 1 - t) & 1 == 1;
            let scores: Vec<f64> = (0..len as usize)
                .map(|t| {
                    let dot = (0..c.d).map(|i| q[i] as f64 * c.keys[row(t) + i] as f64).sum::<f64>();
                    if seen(t) {
                        dot * scale as f64
                    } else {
                        f64::NEG_INFINITY
                    }
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for i in 0..c.d {
                out[(s * c.hq + qh) * c.d + i] =
                    (0..len as usize).map(|t| weights[t] / total * c.values[row(t) + i] as f64).sum();
            }
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[f64]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= 1e-5 + 1e-5 * w.abs(), "element {i}: {g} vs {w}");
    }
}

#[test]
fn grouped_query_heads_over_shuffled_pages_match_dense_attention() {
    // 0: a sequence with no keys yet; 5 and 17: partial last blocks; 64: several full blocks.
    let c = case(&[5, 0, 17, 64, 1], 4, 2, 8, 16, 7);
    let out = run(&c, 0.25).unwrap();
    assert_close(&out, &dense(&c, 0.25));
    let hq_d = c.hq * c.d;
    assert!(out[hq_d..2 * hq_d].iter().all(|&x| x == 0.0), "an empty sequence gets zeros");
}

#[test]
fn hidden_keys_get_no_weight() {
    // A token tree's rows: each sees the keys before the tree and its own path. Masks over 70
    // and 3 keys (older keys always seen), one hiding every key but its own, one seeing all.
    for d in [8, 12, 64] {
        let mut c = case(&[70, 3, 20, 9], 16, 2, 4, d, 5 + d as u64);
        c.masks = Some(vec![!0b0110_1010u64 | 1, 0b101, 1 << 63 | 1, u64::MAX]);
        let out = run(&c, 0.3).unwrap();
        assert_close(&out, &dense(&c, 0.3));
        let mut plain = c.clone();
        plain.masks = None;
        assert_ne!(out, run(&plain, 0.3).unwrap(), "the masks changed something");
    }
}

#[test]
fn pages_of_sixteen_keys_match_dense_attention() {
    // blocks of 16 with partial blocks of 5, 3 and 4 keys after them. Head dims 8 to 128 in steps
    // of 8 take the AVX2 path where the CPU has it (one compiled instance per head dim, values
    // taken 8, 4, 2 or 1 keys at a time): 8, 16, 24 and 32 cover the four, 64 and 128 the common
    // sizes; 136 takes the portable loops.
    for d in [8, 16, 24, 32, 64, 128, 136] {
        let c = case(&[37, 16, 3, 100], 16, 2, 4, d, 13 + d as u64);
        assert_close(&run(&c, 0.125).unwrap(), &dense(&c, 0.125));
    }
}

#[test]
fn head_dims_that_are_not_a_multiple_of_eight_use_the_tail() {
    for d in [1, 12, 20] {
        let c = case(&[9, 30], 16, 1, 3, d, 11 + d as u64);
        assert_close(&run(&c, 0.5).unwrap(), &dense(&c, 0.5));
    }
}

#[test]
fn large_scores_do_not_overflow_the_softmax() {
    let mut c = case(&[40], 8, 2, 2, 8, 3);
    c.keys.iter_mut().for_each(|k| *k *= 400.0);
    let out = run(&c, 1.0).unwrap();
    assert!(out.iter().all(|x| x.is_finite()));
    assert_close(&out, &dense(&c, 1.0));
}

#[test]
fn bad_inputs_are_refused_naming_what_is_wrong() {
    let mut c = case(&[5, 9], 4, 2, 4, 8, 5);
    c.tables[c.width] = 999;
    assert_eq!(run(&c, 1.0), Err(AttentionError::BlockOutOfRange { seq: 1, block: 999, num_blocks: 6 }));
    let mut c = case(&[5, 9], 4, 2, 4, 8, 5);
    c.lens[0] = 100;
    assert!(matches!(run(&c, 1.0), Err(AttentionError::TooLong { seq: 0, len: 100, .. })));
    let mut c = case(&[5], 4, 2, 3, 8, 5);
    c.queries.truncate(10);
    assert!(matches!(run(&c, 1.0), Err(AttentionError::Shape(m)) if m.contains("num_q_heads 3")));
}

#[test]
fn sequences_spread_over_lent_threads_give_the_same_bits() {
    // 40 sequences of 0-300 keys, 8 query heads of 32: over the work threshold, so the batch is
    // split (four ranges per thread) and each range written by whichever thread took it.
    let lens: Vec<i32> = (0..40).map(|i| i * 37 % 301).collect();
    let c = case(&lens, 16, 2, 8, 32, 21);
    let pool = ScopedThreads::new(2);
    let spread = run_on(Some(&pool), &c, 0.2).unwrap();
    assert_eq!(*pool.calls.lock().unwrap(), vec![8]);
    assert_eq!(pool.workers.lock().unwrap().len(), 2);
    let alone = run(&c, 0.2).unwrap();
    assert_eq!(
        spread.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_close(&spread, &dense(&c, 0.2));
}

#[test]
fn fewer_sequences_than_parts_spread_their_kv_heads_over_lent_threads_with_the_same_bits() {
    // two long sequences (a batch of one or two decoding a long context), 3 kv heads of 3 query
    // heads each: six (sequence, kv head) parts, under the eight a thread pair splits a batch into
    let mut c = case(&[900, 613], 16, 3, 9, 64, 8);
    c.masks = Some(vec![!0b1010, u64::MAX]); // the first one a token tree's: two of its last keys hidden
    let pool = ScopedThreads::new(2);
    let spread = run_on(Some(&pool), &c, 0.125).unwrap();
    assert_eq!(*pool.calls.lock().unwrap(), vec![6]);
    let alone = run(&c, 0.125).unwrap();
    assert_eq!(
        spread.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_close(&spread, &dense(&c, 0.125));
}

#[test]
fn a_small_batch_stays_on_the_calling_thread() {
    let c = case(&[30, 12, 7], 16, 2, 4, 16, 4);
    let pool = ScopedThreads::new(2);
    assert_close(&run_on(Some(&pool), &c, 0.5).unwrap(), &dense(&c, 0.5));
    assert!(pool.calls.lock().unwrap().is_empty());
}
