//! Micro-benchmarks of the scheduling core on a 100_000-block pool (block size 16):
//!
//! - `block_pool`: `pop_free` then `decref` + `push_free`, 1000 blocks per iteration.
//! - `radix`: building a ~100k-block tree with `insert`, `match_prefix` of a cached 64-block
//!   chain, and `evict_lru` of every block after `mark_unreferenced` (trees are built in setup).
//! - `scheduler`: one `schedule` + `update` decode step with 256 and 1024 running requests.
//!
//! Run with `cargo bench -p pyserve-core --bench core` (add `-- --quick` for a fast pass).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, SamplingMode, Throughput};
use pyserve_core::{BlockId, BlockPool, Namespace, NewRequest, RadixCache, Scheduler, SchedulerConfig};

const NUM_BLOCKS: usize = 100_000;
const BS: usize = 16;

fn block_pool(c: &mut Criterion) {
    const OPS: usize = 1000;
    let mut g = c.benchmark_group("block_pool");
    g.throughput(Throughput::Elements(OPS as u64));
    let mut pool = BlockPool::new(NUM_BLOCKS).unwrap();
    let mut held: Vec<BlockId> = Vec::with_capacity(OPS);
    g.bench_function("alloc_free_1000", |b| {
        b.iter(|| {
            for _ in 0..OPS {
                held.push(pool.pop_free().unwrap());
            }
            for block in held.drain(..).rev() {
                if pool.decref(block) == 0 {
                    pool.push_free(block);
                }
            }
            black_box(pool.num_free())
        })
    });
    g.finish();
}

/// Chains of 64 blocks: 127 groups of 16 sequences that share a 16-block prefix, each sequence
/// with 48 blocks of its own; 99_568 blocks in all. Every block's tokens are distinct.
struct Chains {
    /// Per sequence: its 1024 tokens, its 64 block ids, and whether it adds the group prefix.
    seqs: Vec<(Vec<u32>, Vec<BlockId>, bool)>,
    num_blocks: usize,
}

const CHAIN: usize = 64;
const SHARED: usize = 16;

fn chains() -> Chains {
    let (groups, per_group) = (127, 16);
    let mut next: BlockId = 1;
    let mut alloc = |n: usize| -> Vec<BlockId> {
        let out = (next..next + n as BlockId).collect();
        next += n as BlockId;
        out
    };
    let tokens_of = |blocks: &[BlockId]| -> Vec<u32> {
        blocks.iter().flat_map(|&b| (0..BS as u32).map(move |j| b * BS as u32 + j)).collect()
    };
    let mut seqs = Vec::new();
    for _ in 0..groups {
        let prefix = alloc(SHARED);
        for s in 0..per_group {
            let mut blocks = prefix.clone();
            blocks.extend(alloc(CHAIN - SHARED));
            seqs.push((tokens_of(&blocks), blocks, s == 0));
        }
    }
    Chains { seqs, num_blocks: (next - 1) as usize }
}

fn build_tree(ch: &Chains) -> RadixCache {
    let ns = Namespace::default();
    let mut tree = RadixCache::new(NUM_BLOCKS, BS);
    for (tokens, blocks, first) in &ch.seqs {
        let start = if *first { 0 } else { SHARED };
        black_box(tree.insert(&ns, tokens, blocks, start));
    }
    tree
}

fn radix(c: &mut Criterion) {
    let ch = chains();
    assert!(ch.num_blocks < NUM_BLOCKS);
    let ns = Namespace::default();
    let mut g = c.benchmark_group("radix");

    // Whole-tree builds and teardowns take milliseconds: few flat samples.
    g.sampling_mode(SamplingMode::Flat).sample_size(10);
    g.throughput(Throughput::Elements(ch.num_blocks as u64));
    g.bench_function("insert_100k_blocks", |b| {
        b.iter_batched(|| (), |()| build_tree(&ch), BatchSize::PerIteration)
    });
    g.bench_function("evict_lru_100k_blocks", |b| {
        b.iter_batched(
            || {
                let mut tree = build_tree(&ch);
                // Release the way the KV manager does: each sequence tail first, then the
                // group prefix once its last sequence is gone.
                for (i, (_, blocks, _)) in ch.seqs.iter().enumerate() {
                    blocks[SHARED..].iter().rev().for_each(|&blk| assert!(tree.mark_unreferenced(blk)));
                    if i % 16 == 15 {
                        blocks[..SHARED].iter().rev().for_each(|&blk| assert!(tree.mark_unreferenced(blk)));
                    }
                }
                assert_eq!(tree.num_unreferenced(), ch.num_blocks);
                tree
            },
            |mut tree| {
                while let Some(block) = tree.evict_lru() {
                    black_box(block);
                }
                assert_eq!(tree.num_cached(), 0);
                tree
            },
            BatchSize::PerIteration,
        )
    });

    g.sampling_mode(SamplingMode::Auto).sample_size(20);
    let tree = build_tree(&ch);
    assert!(ch.seqs.iter().all(|(tokens, blocks, _)| tree.match_prefix(&ns, tokens, usize::MAX).blocks == *blocks));
    g.throughput(Throughput::Elements(CHAIN as u64));
    let mut i = 0;
    g.bench_function("match_prefix_hit_64_blocks", |b| {
        b.iter(|| {
            i = (i + 97) % ch.seqs.len();
            tree.match_prefix(&ns, &ch.seqs[i].0, usize::MAX)
        })
    });
    // Group prefix hit, then a miss on the first block of a sequence that is not cached.
    g.throughput(Throughput::Elements(SHARED as u64));
    let mut query = ch.seqs[0].0.clone();
    query[SHARED * BS] = u32::MAX;
    assert_eq!(tree.match_prefix(&ns, &query, usize::MAX).blocks.len(), SHARED);
    g.bench_function("match_prefix_partial_16_blocks", |b| {
        b.iter(|| tree.match_prefix(&ns, black_box(&query), usize::MAX))
    });
    g.finish();
}

/// Decode steps taken before the scheduler is rebuilt (untimed), so sequences stay short
/// (128..~650 tokens) and the pool never fills.
const STEPS_PER_BUILD: usize = 512;

/// A scheduler with `n` running requests, all past prefill. Prompts are 128 tokens: a 64-token
/// prefix shared by all, then 64 tokens of their own.
fn warm_scheduler(n: usize) -> Scheduler {
    let mut cfg = SchedulerConfig::new(NUM_BLOCKS, BS);
    cfg.max_num_seqs = 2048;
    cfg.max_num_batched_tokens = 8192;
    cfg.enable_prefix_caching = true;
    let mut sched = Scheduler::new(cfg).unwrap();
    for id in 0..n as u64 {
        let mut prompt: Vec<u32> = (0..64).collect();
        prompt.extend((0..64).map(|j| ((id * 64 + j) % 1000) as u32));
        let mut req = NewRequest::new(id, prompt);
        req.max_tokens = Some(2048);
        sched.add_request(req).unwrap();
    }
    loop {
        let out = sched.schedule().unwrap();
        let counts: Vec<u32> = out.num_logits.iter().map(|&k| k as u32).collect();
        let tokens = vec![7; counts.iter().sum::<u32>() as usize];
        sched.update(&tokens, &counts).unwrap();
        if out.num_reqs() == n && out.total_num_tokens() == n {
            return sched; // a pure decode step: everyone is past prefill
        }
    }
}

fn scheduler(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler");
    for n in [256usize, 1024] {
        g.throughput(Throughput::Elements(n as u64));
        let tokens: Vec<u32> = (0..n as u32).map(|i| i * 7 % 1000).collect();
        let counts = vec![1u32; n];
        let mut sched = warm_scheduler(n);
        let mut steps = 0;
        g.bench_function(format!("decode_step_{n}_reqs"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if steps == STEPS_PER_BUILD {
                        sched = warm_scheduler(n);
                        steps = 0;
                    }
                    let t = Instant::now();
                    let out = sched.schedule().unwrap();
                    let res = sched.update(&tokens, &counts).unwrap();
                    total += t.elapsed();
                    assert!(out.num_reqs() == n && res.finished.is_empty()); // untimed
                    black_box((out, res));
                    steps += 1;
                }
                total
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = block_pool, radix, scheduler
}
criterion_main!(benches);
