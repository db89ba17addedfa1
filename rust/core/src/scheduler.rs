//! The per-step scheduler.
//!
//! There are no prefill and decode phases: every request has `num_computed_tokens` catching up
//! with its tokens (plus draft tokens), and one step spends one token budget. Running requests
//! go first in queue order (priority, then arrival); when blocks run out the last of them (lowest
//! priority, newest) is preempted by recompute and put back at the head of the waiting queue.
//! Waiting requests are admitted with their cached prefix only when nothing was preempted.

use std::collections::BTreeMap;

use crate::config::SchedulerConfig;
use crate::error::{request_err, step_err, CoreError, Result};
use crate::kv_manager::KvCacheManager;
use crate::output::ScheduledRequest;
use crate::request::{NewRequest, Request, RequestId, RequestStatus};
use crate::request_table::{RequestTable, Slot};

mod step;

pub(crate) type QueueKey = (i32, i64);

/// Requests of this priority or more are background work (pyserve's batch jobs): a step that
/// computes a foreground request's prompt schedules no background request, so background work
/// never slows a first token; a foreground request takes a background one's KV blocks, or its
/// seat when `max_num_seqs` run; otherwise they are scheduled after the foreground, as many as
/// the caller's per-step limit allows, with at most a block of prompt tokens a step under such a
/// limit (see `Scheduler::schedule_with_budget`).
pub const BACKGROUND_PRIORITY: i32 = 1_000_000;

/// One request's share of the step in flight, with its `num_computed_tokens` before the step.
type Planned = (Slot, ScheduledRequest, usize);

/// The most drafts a token tree may hold: with the request's last token, 64 rows, so that each
/// row's view of the tree fits a 64-bit mask (the attention kernels' `masks`).
pub const MAX_TREE_DRAFTS: usize = 63;

/// Counters since construction, plus gauges of now. The names are the engine's and /metrics'
/// (`pyserve:<name>`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_requests_waiting: usize,
    pub num_requests_running: usize,
    pub kv_cache_usage_perc: f64,
    pub kv_free_blocks: usize,
    pub kv_cached_blocks: usize,
    pub num_preemptions: u64,
    /// Prompt tokens looked up in the prefix cache at first admission, and how many were hits
    /// (the last prompt token is always computed, so a full hit is `n - 1` of `n`).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_steps: u64,
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: RequestTable,
    waiting: BTreeMap<QueueKey, Slot>,
    /// Sorted by queue key.
    running: Vec<(QueueKey, Slot)>,
    next_order: i64,
    next_head_order: i64,
    /// The step in flight (between `schedule` and `update`): slot, share, tokens computed
    /// before. The buffer is reused from step to step.
    plan: Vec<Planned>,
    in_flight: bool,
    finished_since_step: Vec<RequestId>,
    /// Held requests that reached their fork point since the last `update` (see
    /// [`UpdateResult::fork_ready`](crate::UpdateResult::fork_ready)).
    fork_ready: Vec<RequestId>,
    stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let kv = KvCacheManager::new(config.num_blocks, config.block_size, config.enable_prefix_caching)?;
        Ok(Self {
            config,
            kv,
            requests: RequestTable::default(),
            waiting: BTreeMap::new(),
            running: Vec::new(),
            next_order: 0,
            next_head_order: -1,
            plan: Vec::new(),
            in_flight: false,
            finished_since_step: Vec::new(),
            fork_ready: Vec::new(),
            stats: SchedulerStats::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request. Refuses, naming the field, one that could never be served: empty or
    /// over-long prompt, `max_tokens` past the model length, or more KV than the whole pool.
    pub fn add_request(&mut self, new: NewRequest) -> Result<()> {
        let cfg = &self.config;
        let prompt_len = new.prompt_token_ids.len();
        if self.requests.contains(new.id) {
            return Err(request_err("request_id", format!("{} is already in use", new.id)));
        }
        if prompt_len == 0 {
            return Err(request_err("prompt_token_ids", "must not be empty"));
        }
        if prompt_len >= cfg.max_model_len {
            return Err(request_err(
                "prompt_token_ids",
                format!(
                    "{prompt_len} tokens leave no room to generate within max_model_len {}",
                    cfg.max_model_len
                ),
            ));
        }
        let room = cfg.max_model_len - prompt_len;
        let max_tokens = new.max_tokens.unwrap_or(room);
        if max_tokens == 0 {
            return Err(request_err("max_tokens", "must be at least 1"));
        }
        if max_tokens > room {
            return Err(request_err(
                "max_tokens",
                format!(
                    "{prompt_len} prompt + {max_tokens} output tokens exceed max_model_len {}",
                    cfg.max_model_len
                ),
            ));
        }
        if new.min_tokens > max_tokens {
            return Err(request_err(
                "min_tokens",
                format!("{} exceeds max_tokens {max_tokens}", new.min_tokens),
            ));
        }
        if new.namespace.adapter_id != 0 && cfg.max_loras == 0 {
            return Err(request_err("adapter_id", "LoRA adapters are disabled (max_loras = 0)"));
        }
        let blocks = self.kv.blocks_for(prompt_len + max_tokens + cfg.num_lookahead_tokens);
        if blocks > self.kv.num_usable_blocks() {
            // The prompt alone is too big: no max_tokens could make it fit.
            let prompt_alone = self.kv.blocks_for(prompt_len + 1) > self.kv.num_usable_blocks();
            return Err(request_err(
                if prompt_alone { "prompt_token_ids" } else { "max_tokens" },
                format!(
                    "{prompt_len} prompt + {max_tokens} output tokens need {blocks} KV blocks; the pool has {}",
                    self.kv.num_usable_blocks()
                ),
            ));
        }
        let req = Request::from_new(new, max_tokens, self.next_order);
        self.next_order += 1;
        let key = req.key();
        let slot = self.requests.insert(req);
        self.waiting.insert(key, slot);
        Ok(())
    }

    /// Starts `child_id` as a copy of `parent_id` that shares its computed KV blocks
    /// (copy-on-write), for `n > 1` sampling. The child inherits the stop limits.
    pub fn fork_request(&mut self, parent_id: RequestId, child_id: RequestId) -> Result<()> {
        if self.in_flight {
            return Err(step_err("step", "cannot fork while a step is in flight"));
        }
        if self.requests.contains(child_id) {
            return Err(request_err("request_id", format!("{child_id} is already in use")));
        }
        let parent = self.requests.by_id(parent_id).ok_or(CoreError::UnknownRequest(parent_id))?;
        let mut child = parent.clone();
        child.id = child_id;
        child.hold_for_fork = false;
        child.order = self.next_order;
        self.next_order += 1;
        child.clear_drafts();
        child.admitted_once = false;
        let can_run =
            parent.status == RequestStatus::Running && self.running.len() < self.config.max_num_seqs;
        if can_run {
            child.forked = true;
            child.block_table = self.kv.fork(parent);
            child.num_inserted_blocks = child.num_inserted_blocks.min(child.block_table.len());
        } else {
            child.status = RequestStatus::Waiting;
            child.block_table.clear();
            child.num_inserted_blocks = 0;
            child.cache_node = None;
            child.num_computed_tokens = 0;
        }
        let key = child.key();
        if can_run {
            let parent_slot = self.requests.slot_of(parent_id).expect("parent is live");
            self.requests[parent_slot].forked = true;
        }
        let slot = self.requests.insert(child);
        if can_run {
            insert_sorted(&mut self.running, (key, slot));
        } else {
            self.waiting.insert(key, slot);
        }
        Ok(())
    }

    /// Lets a request added with `hold_for_fork` compute its last prompt token (its samples
    /// are forked).
    pub fn release_hold(&mut self, id: RequestId) -> Result<()> {
        let slot = self.requests.slot_of(id).ok_or(CoreError::UnknownRequest(id))?;
        self.requests[slot].hold_for_fork = false;
        Ok(())
    }

    /// Drops a request wherever it is; its blocks are freed (cached ones stay cached).
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        let slot = self.requests.slot_of(id).ok_or(CoreError::UnknownRequest(id))?;
        let mut req = self.requests.remove(slot);
        match req.status {
            RequestStatus::Running => {
                if let Some(pos) = self.running.iter().position(|&(_, s)| s == slot) {
                    self.running.remove(pos);
                }
            }
            _ => {
                self.waiting.remove(&req.key());
            }
        }
        self.kv.free(&mut req);
        self.finished_since_step.push(id);
        Ok(())
    }

    /// Sets the draft tokens to verify at the request's next step (replacing earlier ones), a
    /// chain. Drafts past the request's token limit are dropped.
    pub fn set_spec_tokens(&mut self, id: RequestId, tokens: &[u32]) -> Result<()> {
        self.set_spec_tree(id, tokens, &[])
    }

    /// Sets a token tree of drafts (at most [`MAX_TREE_DRAFTS`]): draft `j`'s parent is
    /// `parents[j]`, 0 for the request's last token or `i` (`1 <= i <= j`) for draft `i - 1`;
    /// empty `parents`: a chain. Drafts are verified at once, each seeing only the tokens before
    /// its own path; the verification keeps one path. Drafts past the request's token limit
    /// (counted by number, not depth) are dropped.
    pub fn set_spec_tree(&mut self, id: RequestId, tokens: &[u32], parents: &[u32]) -> Result<()> {
        if !parents.is_empty() {
            if parents.len() > MAX_TREE_DRAFTS {
                return Err(request_err(
                    "spec_parents",
                    format!("a tree of {} drafts: at most {MAX_TREE_DRAFTS}", parents.len()),
                ));
            }
            if parents.len() != tokens.len() {
                return Err(request_err(
                    "spec_parents",
                    format!("{} parents for {} draft tokens", parents.len(), tokens.len()),
                ));
            }
            if let Some(j) = parents.iter().enumerate().position(|(j, &p)| p as usize > j) {
                return Err(request_err(
                    "spec_parents",
                    format!("draft {j}'s parent {} does not come before it", parents[j]),
                ));
            }
        }
        let max_model_len = self.config.max_model_len;
        let slot = self.requests.slot_of(id).ok_or(CoreError::UnknownRequest(id))?;
        let req = &mut self.requests[slot];
        let limit = (req.num_prompt_tokens + req.max_tokens).min(max_model_len);
        let room = limit.saturating_sub(req.num_tokens());
        req.clear_drafts();
        if req.status == RequestStatus::Running {
            let n = tokens.len().min(room);
            req.spec_token_ids.extend_from_slice(&tokens[..n]);
            if parents.iter().take(n).enumerate().any(|(j, &p)| p as usize != j) {
                req.spec_parents.extend_from_slice(&parents[..n]);
            }
        }
        Ok(())
    }

    /// Draft tokens for a request by n-gram lookup in its own prompt and output (see
    /// [`crate::ngram::propose`]); they are not set: pass them to [`Self::set_spec_tokens`].
    pub fn propose_ngram(&self, id: RequestId, k: usize, min_n: usize, max_n: usize) -> Result<&[u32]> {
        let req = self.requests.by_id(id).ok_or(CoreError::UnknownRequest(id))?;
        Ok(crate::ngram::propose(&req.token_ids, min_n, max_n, k))
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.requests.is_empty()
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.by_id(id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Whether a request below BACKGROUND_PRIORITY is running or waiting (both queues are in
    /// priority order: their first entries tell).
    pub fn has_foreground_requests(&self) -> bool {
        let foreground = |key: &QueueKey| key.0 < BACKGROUND_PRIORITY;
        self.running.first().is_some_and(|(key, _)| foreground(key))
            || self.waiting.keys().next().is_some_and(foreground)
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_requests_waiting: self.waiting.len(),
            num_requests_running: self.running.len(),
            kv_cache_usage_perc: self.kv.usage(),
            kv_free_blocks: self.kv.num_free(),
            kv_cached_blocks: self.kv.num_cached(),
            ..self.stats.clone()
        }
    }

    /// Verifies every bookkeeping invariant (queues, statuses, refcounts, free and cached
    /// blocks). Meant for tests; cost is linear in requests and blocks.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut queued = 0;
        for (key, &slot) in &self.waiting {
            let req = self.requests.get(slot).ok_or(format!("waiting slot {slot} is not live"))?;
            let id = req.id;
            if req.key() != *key || !matches!(req.status, RequestStatus::Waiting | RequestStatus::Preempted) {
                return Err(format!("waiting {id} has key {:?} status {:?}", req.key(), req.status));
            }
            if !req.block_table.is_empty() {
                return Err(format!("waiting {id} holds blocks"));
            }
            queued += 1;
        }
        for w in self.running.windows(2) {
            if w[0].0 >= w[1].0 {
                return Err("running queue is not sorted".into());
            }
        }
        for &(key, slot) in &self.running {
            let req = self.requests.get(slot).ok_or(format!("running slot {slot} is not live"))?;
            let id = req.id;
            if req.key() != key || req.status != RequestStatus::Running {
                return Err(format!("running {id} has key {:?} status {:?}", req.key(), req.status));
            }
            let needed = self.kv.blocks_for(req.num_computed_tokens);
            if req.block_table.len() < needed {
                return Err(format!("running {id} holds {} blocks for {needed}", req.block_table.len()));
            }
            queued += 1;
        }
        if queued != self.requests.len() {
            return Err(format!("{} live requests, {queued} queued", self.requests.len()));
        }
        self.kv.check(self.requests.values().map(|r| r.block_table.as_slice()))
    }
}

fn insert_sorted(running: &mut Vec<(QueueKey, Slot)>, entry: (QueueKey, Slot)) {
    let pos = running.partition_point(|e| e.0 < entry.0);
    running.insert(pos, entry);
}
