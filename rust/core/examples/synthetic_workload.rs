//! Drives the [`Scheduler`] with a synthetic workload and a fake model, then prints a summary.
//!
//! 200 requests arrive over time with random prompt lengths; about half start with the same
//! 256-token system prompt (prefix-cache hits), a few are aborted mid-flight, and the KV pool is
//! small enough that requests get preempted and recomputed. The "model" samples
//! `(last token * 31 + position) % 1000`, so every output is deterministic and can be checked
//! when a preempted request is recomputed.
//!
//! `cargo run -p pyserve-core --example synthetic_workload`

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use pyserve_core::{FinishReason, NewRequest, Scheduler, SchedulerConfig};

const NUM_REQUESTS: u64 = 200;
const CHECK_EVERY: u64 = 25;

/// xorshift64*: enough randomness for a workload, no dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }
}

/// The fake model: the token that follows `token` at `position`.
fn next_token(token: u32, position: i64) -> u32 {
    ((token as i64 * 31 + position) % 1000) as u32
}

struct Arrival {
    step: u64,
    req: NewRequest,
    abort_at: Option<u64>,
}

fn main() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let system: Vec<u32> = (0..256).map(|_| rng.below(1000) as u32).collect();
    let arrivals: Vec<Arrival> = (0..NUM_REQUESTS)
        .map(|id| {
            let mut prompt = if rng.below(2) == 0 { system.clone() } else { Vec::new() };
            let len = rng.range(8, 384);
            prompt.extend((0..len).map(|_| rng.below(1000) as u32));
            let mut req = NewRequest::new(id, prompt);
            req.max_tokens = Some(rng.range(8, 200) as usize);
            if id % 4 == 0 {
                req.stop_token_ids = (0..10).map(|k| k * 100).collect(); // may stop early
            }
            let step = id * 3 + rng.below(3);
            let abort_at = (id % 23 == 7).then(|| step + rng.range(5, 60));
            Arrival { step, req, abort_at }
        })
        .collect();
    let prompt_len: HashMap<u64, usize> =
        arrivals.iter().map(|a| (a.req.id, a.req.prompt_token_ids.len())).collect();

    // 255 usable blocks of 16 tokens: far less than the live requests want, so preemption.
    let mut config = SchedulerConfig::new(256, 16);
    config.max_num_batched_tokens = 512;
    config.max_num_seqs = 64;
    let mut sched = Scheduler::new(config).expect("valid config");

    let started = Instant::now();
    let (mut step, mut next, mut total_tokens, mut batched_reqs) = (0u64, 0, 0usize, 0usize);
    let mut live = HashSet::new();
    let mut reasons: HashMap<FinishReason, usize> = HashMap::new();
    while next < arrivals.len() || sched.has_unfinished_requests() {
        while next < arrivals.len() && arrivals[next].step <= step {
            sched.add_request(arrivals[next].req.clone()).expect("valid request");
            live.insert(arrivals[next].req.id);
            next += 1;
        }
        let out = sched.schedule().expect("schedule");
        // Aborts land while the step is in flight, as they would from another thread.
        for a in arrivals.iter().filter(|a| a.abort_at == Some(step)) {
            if live.remove(&a.req.id) {
                sched.abort(a.req.id).expect("live request");
                *reasons.entry(FinishReason::Abort).or_default() += 1;
            }
        }

        // The fake model: check that re-fed outputs follow the model, then sample.
        let (mut sampled, mut counts) = (Vec::new(), Vec::new());
        for (i, &id) in out.req_ids.iter().enumerate() {
            let (lo, hi) = (out.query_start_loc[i] as usize, out.query_start_loc[i + 1] as usize);
            for t in lo + 1..hi {
                if out.positions[t] as usize >= prompt_len[&id] {
                    let want = next_token(out.input_ids[t - 1] as u32, out.positions[t - 1]);
                    assert_eq!(out.input_ids[t] as u32, want, "request {id} lost an output token");
                }
            }
            counts.push(out.num_logits[i] as u32);
        }
        for &idx in &out.logits_indices {
            let idx = idx as usize;
            sampled.push(next_token(out.input_ids[idx] as u32, out.positions[idx]));
        }
        let result = sched.update(&sampled, &counts).expect("update");
        for (id, reason) in result.finished {
            live.remove(&id);
            *reasons.entry(reason).or_default() += 1;
        }

        total_tokens += out.total_num_tokens();
        batched_reqs += out.num_reqs();
        step += 1;
        if step % CHECK_EVERY == 0 {
            sched.check_invariants().unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
        assert!(step < 1_000_000, "no progress");
    }
    sched.check_invariants().unwrap_or_else(|e| panic!("at the end: {e}"));
    let wall = started.elapsed().as_secs_f64();

    let stats = sched.stats();
    let count = |r| reasons.get(&r).copied().unwrap_or(0);
    println!(
        "requests:            {NUM_REQUESTS} ({} length, {} stop, {} aborted)",
        count(FinishReason::Length),
        count(FinishReason::Stop),
        count(FinishReason::Abort)
    );
    println!("steps:               {step}");
    println!("tokens scheduled:    {total_tokens}");
    println!("preemptions:         {}", stats.num_preemptions);
    println!(
        "prefix cache:        {} hit / {} queried tokens ({:.1}%)",
        stats.prefix_cache_hits,
        stats.prefix_cache_queries,
        100.0 * stats.prefix_cache_hits as f64 / stats.prefix_cache_queries.max(1) as f64
    );
    println!("mean batch size:     {:.1} requests", batched_reqs as f64 / step as f64);
    println!("wall time:           {:.3} s ({:.0} steps/s)", wall, step as f64 / wall);
    assert_eq!(reasons.values().sum::<usize>(), NUM_REQUESTS as usize);
}
