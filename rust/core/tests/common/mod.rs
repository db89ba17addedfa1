//! A deterministic fake model and a driver that runs the scheduler against it, checking on
//! every step that the KV read back through block tables is exactly the request's context.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};

use pyserve_core::{
    FinishReason, NewRequest, RequestId, Scheduler, SchedulerConfig, SchedulerOutput, UpdateResult,
};

pub const VOCAB: u32 = 40;

/// A config of `num_blocks` blocks of `block_size` tokens, a step budget of `budget` tokens and
/// sequences of at most 256 tokens; the engine's defaults otherwise.
pub fn config(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(num_blocks, block_size);
    c.max_num_batched_tokens = budget;
    c.max_model_len = 256;
    c
}

/// A request for `prompt` that stops after `max_tokens` output tokens.
pub fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    let mut r = NewRequest::new(id, prompt);
    r.max_tokens = Some(max_tokens);
    r
}

/// A proposer with no guesses.
pub fn no_drafts(_: &[u32]) -> Vec<u32> {
    Vec::new()
}

/// Next token after `ctx`: a hash of the whole context.
pub fn next_token(ctx: &[u32]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in ctx {
        h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(VOCAB)) as u32
}

/// Greedy output of the fake model for `prompt` under the request's stop limits.
pub fn reference_output(prompt: &[u32], max_tokens: usize, eos: Option<u32>) -> (Vec<u32>, FinishReason) {
    let mut seq = prompt.to_vec();
    loop {
        let t = next_token(&seq);
        seq.push(t);
        if Some(t) == eos {
            return (seq[prompt.len()..].to_vec(), FinishReason::Stop);
        }
        if seq.len() - prompt.len() >= max_tokens {
            return (seq[prompt.len()..].to_vec(), FinishReason::Length);
        }
    }
}

/// KV storage: the (token, position) written to each slot.
pub struct FakeKv {
    slots: Vec<Option<(i32, i64)>>,
    block_size: usize,
}

impl FakeKv {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self { slots: vec![None; num_blocks * block_size], block_size }
    }

    /// Copies, writes, then reads back the context of every sampled position. Returns, per
    /// scheduled request, the contexts it read (one per logits position).
    pub fn forward(&mut self, out: &SchedulerOutput) -> Vec<Vec<Vec<u32>>> {
        let bs = self.block_size;
        for pair in out.block_copies.chunks(2) {
            let (src, dst) = (pair[0] as usize * bs, pair[1] as usize * bs);
            for i in 0..bs {
                self.slots[dst + i] = self.slots[src + i];
            }
        }
        for t in 0..out.total_num_tokens() {
            self.slots[out.slot_mapping[t] as usize] = Some((out.input_ids[t], out.positions[t]));
        }
        let mut contexts = Vec::with_capacity(out.num_reqs());
        let mut li = 0;
        for r in 0..out.num_reqs() {
            let row = &out.block_tables[r * out.block_table_width..(r + 1) * out.block_table_width];
            let mut per_req = Vec::new();
            for _ in 0..out.num_logits[r] {
                let p = out.positions[out.logits_indices[li] as usize] as usize;
                li += 1;
                let ctx = (0..=p)
                    .map(|q| {
                        let slot = row[q / bs] as usize * bs + q % bs;
                        let (tok, pos) =
                            self.slots[slot].unwrap_or_else(|| panic!("slot {slot} never written"));
                        assert_eq!(pos as usize, q, "slot {slot} holds position {pos}, read as {q}");
                        tok as u32
                    })
                    .collect();
                per_req.push(ctx);
            }
            contexts.push(per_req);
        }
        contexts
    }
}

/// What the driver knows of a live request.
pub struct Live {
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    pub drafts: Vec<u32>,
    pub max_tokens: usize,
    pub eos: Option<u32>,
    pub adapter: u32,
}

/// Drives a scheduler with greedy sampling and speculative drafts, recording finished outputs.
pub struct Driver {
    pub sched: Scheduler,
    pub kv: FakeKv,
    pub live: HashMap<RequestId, Live>,
    pub finished: BTreeMap<RequestId, (Vec<u32>, FinishReason)>,
    pub steps: usize,
    /// What the last `update` returned.
    pub last: UpdateResult,
    /// The budget each step is scheduled with (see `Scheduler::schedule_with_budget`).
    pub token_budget: Option<usize>,
    /// The most background requests each step may schedule (ditto).
    pub max_background: Option<usize>,
}

impl Driver {
    pub fn new(sched: Scheduler) -> Self {
        let cfg = sched.config().clone();
        Self {
            kv: FakeKv::new(cfg.num_blocks, cfg.block_size),
            sched,
            live: HashMap::new(),
            finished: BTreeMap::new(),
            steps: 0,
            last: UpdateResult::default(),
            token_budget: None,
            max_background: None,
        }
    }

    pub fn add(&mut self, req: NewRequest) -> pyserve_core::Result<()> {
        let live = Live {
            prompt: req.prompt_token_ids.clone(),
            tokens: req.prompt_token_ids.clone(),
            drafts: Vec::new(),
            max_tokens: req.max_tokens.unwrap_or(usize::MAX),
            eos: req.eos_token_id,
            adapter: req.namespace.adapter_id,
        };
        let id = req.id;
        self.sched.add_request(req)?;
        self.live.insert(id, live);
        Ok(())
    }

    pub fn abort(&mut self, id: RequestId) {
        self.sched.abort(id).unwrap();
        self.live.remove(&id);
    }

    pub fn fork(&mut self, parent: RequestId, child: RequestId) {
        self.sched.fork_request(parent, child).unwrap();
        let p = &self.live[&parent];
        let copy = Live { drafts: Vec::new(), tokens: p.tokens.clone(), prompt: p.prompt.clone(), ..*p };
        self.live.insert(child, copy);
    }

    /// One schedule/forward/update round. `draft` proposes drafts for a request's tokens.
    pub fn step(&mut self, mut draft: impl FnMut(&[u32]) -> Vec<u32>) -> SchedulerOutput {
        let decoding = self.decoding();
        let out = self.sched.schedule_with_budget(self.token_budget, self.max_background).unwrap();
        let cfg = self.sched.config().clone();
        let scheduled: usize = out.num_scheduled_tokens.iter().map(|&n| n as usize).sum();
        assert!(scheduled <= cfg.max_num_batched_tokens, "budget exceeded: {scheduled}");
        if let (Some(budget), false) = (self.token_budget, decoding.is_empty()) {
            let decode_tokens: usize = (0..out.num_reqs())
                .filter(|&r| decoding.contains(&out.req_ids[r]))
                .map(|r| out.num_scheduled_tokens[r] as usize)
                .sum();
            let allowed = budget.min(cfg.max_num_batched_tokens).saturating_sub(decode_tokens);
            let prompt_tokens = scheduled - decode_tokens;
            assert!(
                prompt_tokens <= allowed.max(cfg.block_size),
                "{prompt_tokens} prompt tokens over {budget}"
            );
        }
        assert!(out.num_reqs() <= cfg.max_num_seqs);
        let mut adapters: Vec<u32> =
            out.req_ids.iter().map(|id| self.live[id].adapter).filter(|&a| a != 0).collect();
        adapters.sort_unstable();
        adapters.dedup();
        assert!(adapters.len() <= cfg.max_loras, "{} adapters in one step", adapters.len());

        let contexts = self.kv.forward(&out);
        let (mut sampled, mut counts) = (Vec::new(), Vec::new());
        for (r, ctxs) in contexts.iter().enumerate() {
            let id = out.req_ids[r];
            let live = &self.live[&id];
            let k = out.num_spec_tokens[r] as usize;
            let mut seq = live.tokens.clone();
            seq.extend_from_slice(&live.drafts[..k]);
            let mut n = 0;
            for (j, ctx) in ctxs.iter().enumerate() {
                assert_eq!(ctx.as_slice(), &seq[..ctx.len()], "request {id} read a wrong KV context");
                let t = next_token(ctx);
                sampled.push(t);
                n += 1;
                if j < k && t != live.drafts[j] {
                    break;
                }
            }
            counts.push(n);
        }
        let cached: Vec<usize> =
            out.req_ids.iter().map(|&id| self.sched.request(id).map_or(0, |r| r.num_cached_tokens)).collect();
        let result = self.sched.update(&sampled, &counts).unwrap();
        let mut offset = 0;
        let mut expected = UpdateResult { starts: vec![0], ..Default::default() };
        for (r, &n) in counts.iter().enumerate() {
            let appended = result.num_appended[r] as usize;
            if let Some(live) = self.live.get_mut(&out.req_ids[r]) {
                if n > 0 {
                    if live.tokens.len() == live.prompt.len() {
                        expected.first_outputs.push((out.req_ids[r], cached[r]));
                    }
                    expected.req_ids.push(out.req_ids[r]);
                    expected.token_ids.extend_from_slice(&sampled[offset..offset + appended]);
                    expected.sampled_index.extend((offset..offset + appended).map(|i| i as u32));
                    expected.starts.push(expected.token_ids.len() as u32);
                }
                live.tokens.extend_from_slice(&sampled[offset..offset + appended]);
            }
            offset += n as usize;
        }
        let step_output = |u: &UpdateResult| {
            (
                u.req_ids.clone(),
                u.token_ids.clone(),
                u.starts.clone(),
                u.sampled_index.clone(),
                u.first_outputs.clone(),
            )
        };
        assert_eq!(step_output(&result), step_output(&expected), "update's step output");
        for &(id, reason) in &result.finished {
            let live = self.live.remove(&id).unwrap();
            self.finished.insert(id, (live.tokens[live.prompt.len()..].to_vec(), reason));
        }
        for (&id, live) in self.live.iter_mut() {
            let state = self.sched.request(id).unwrap();
            if state.status != pyserve_core::RequestStatus::Running
                || state.num_computed_tokens + 1 != live.tokens.len()
            {
                live.drafts.clear();
                continue;
            }
            let drafts = draft(&live.tokens);
            self.sched.set_spec_tokens(id, &drafts).unwrap();
            live.drafts = self.sched.request(id).unwrap().spec_token_ids.clone();
        }
        self.sched.check_invariants().unwrap();
        self.steps += 1;
        self.last = result;
        out
    }

    /// Running requests caught up with their tokens after producing output: at the next step
    /// they compute their last token and drafts.
    pub fn decoding(&self) -> HashSet<RequestId> {
        self.live
            .keys()
            .copied()
            .filter(|&id| {
                let r = self.sched.request(id).expect("live");
                r.status == pyserve_core::RequestStatus::Running
                    && r.num_output_tokens() > 0
                    && r.num_computed_tokens + 1 == r.num_tokens()
            })
            .collect()
    }

    /// Steps until nothing is left; panics past `max_steps` (a stuck queue).
    pub fn run_to_end(&mut self, max_steps: usize, mut draft: impl FnMut(&[u32]) -> Vec<u32>) {
        let start = self.steps;
        while self.sched.has_unfinished_requests() {
            assert!(self.steps - start < max_steps, "no progress after {max_steps} steps");
            self.step(&mut draft);
        }
    }
}

/// Drafts that follow the fake model for `good` tokens, then go wrong.
pub fn drafts_with(tokens: &[u32], good: usize, total: usize) -> Vec<u32> {
    let mut seq = tokens.to_vec();
    let mut out = Vec::with_capacity(total);
    for i in 0..total {
        let t = next_token(&seq);
        let t = if i < good { t } else { (t + 1) % VOCAB };
        out.push(t);
        seq.push(t);
    }
    out
}
