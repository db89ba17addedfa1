//! One step: `schedule` decides who runs and builds the flat arrays; `update` takes the
//! sampled tokens back, rolls back rejected drafts and finishes requests.

use std::ops::Bound::{Excluded, Unbounded};

use super::{insert_sorted, Planned, QueueKey, Scheduler, BACKGROUND_PRIORITY};
use crate::error::{step_err, Result};
use crate::output::{ScheduledRequest, SchedulerOutput, UpdateResult};
use crate::radix::PrefixMatch;
use crate::request::{RequestId, RequestStatus};

impl Scheduler {
    /// Decides one step within `max_num_batched_tokens`. Call [`Self::update`] with its results
    /// before the next `schedule` (with empty arrays when nothing was scheduled).
    ///
    /// NOTE: drop the state of `finished_req_ids` before setting up the scheduled requests: an
    /// aborted id may be reused by a new request in the same step.
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        self.schedule_with_budget(None, None)
    }

    /// [`Self::schedule`], with the step held to about `token_budget` tokens while requests
    /// decode: decoding requests (caught up, with output: their last token and drafts) are
    /// scheduled as before, and requests computing a prompt share what the decodes leave of the
    /// budget, at least `block_size` tokens so that they always progress. With no request
    /// decoding, or `None`, the step may spend all of `max_num_batched_tokens`. At most
    /// `max_background` background requests run in the step (`None`: no limit), their prompts
    /// at most `block_size` tokens of it (a step an interactive request may arrive during stays
    /// short); the others keep their blocks and wait.
    pub fn schedule_with_budget(
        &mut self,
        token_budget: Option<usize>,
        max_background: Option<usize>,
    ) -> Result<SchedulerOutput> {
        if self.in_flight {
            return Err(step_err("step", "the previous step has not been updated"));
        }
        let (max_loras, lookahead) = (self.config.max_loras, self.config.num_lookahead_tokens);
        let mut budget = self.config.max_num_batched_tokens;
        // Tokens of requests that are not decoding; every scheduled token also counts in `budget`.
        let mut prompt_budget = token_budget.map_or(budget, |b| self.prompt_allowance(b));
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        let mut loras: Vec<u32> = Vec::new();
        let mut copies = Vec::new();
        let mut out = SchedulerOutput { step: self.stats.num_steps, ..Default::default() };

        // Foreground requests first (running ones in queue order, victims taken from the back,
        // then waiting ones); background requests (priority >= BACKGROUND_PRIORITY) only in a
        // step that computes no foreground prompt, so that they never slow a first token, and
        // at most `max_background` of them.
        let mut foreground_prompt = false;
        for background in [false, true] {
            if background && foreground_prompt {
                break;
            }
            // The step's length in requests this class may not reach.
            let limit = match max_background {
                Some(n) if background => plan.len() + n,
                _ => usize::MAX,
            };
            if background && max_background.is_some() {
                prompt_budget = prompt_budget.min(self.config.block_size);
            }
            let mut i = 0;
            while i < self.running.len() && budget > 0 && plan.len() < limit {
                let (key, slot) = self.running[i];
                if (key.0 >= BACKGROUND_PRIORITY) != background {
                    i += 1;
                    continue;
                }
                let req = &self.requests[slot];
                let start = req.num_computed_tokens;
                let decoding = req.is_decoding();
                let cap = if decoding { budget } else { budget.min(prompt_budget) };
                let num_new = (req.compute_limit() - start).min(cap);
                if num_new == 0 || !lora_fits(&loras, req.namespace.adapter_id, max_loras) {
                    i += 1;
                    continue;
                }
                let reaches_end = start + num_new >= req.num_tokens();
                let slots = start + num_new + if reaches_end { lookahead } else { 0 };
                let mut scheduled = true;
                while !self.kv.allocate_slots(&mut self.requests[slot], &PrefixMatch::NONE, slots, &mut copies) {
                    let &(victim_key, victim) = self.running.last().expect("the request itself is running");
                    if background && victim_key.0 < BACKGROUND_PRIORITY {
                        scheduled = false; // a background request never preempts a foreground one
                        break;
                    }
                    self.preempt_last(&mut out.preempted_req_ids);
                    if victim == slot {
                        scheduled = false;
                        break;
                    }
                }
                if !scheduled {
                    break;
                }
                let req = &mut self.requests[slot];
                let num_spec = (start + num_new).saturating_sub(req.num_tokens());
                req.truncate_drafts(num_spec);
                let num_logits = if reaches_end { 1 + num_spec } else { 0 };
                let s = ScheduledRequest {
                    id: req.id,
                    num_tokens: num_new,
                    num_spec_tokens: num_spec,
                    num_logits,
                };
                plan.push((slot, s, start));
                add_lora(&mut loras, req.namespace.adapter_id);
                budget -= num_new;
                if !decoding {
                    prompt_budget -= num_new;
                    foreground_prompt |= !background;
                }
                i += 1;
            }
            // Waiting requests of this class, only when nothing had to be preempted.
            let mut cursor: Option<QueueKey> = None;
            while out.preempted_req_ids.is_empty() && budget.min(prompt_budget) > 0 && plan.len() < limit {
                let next = match cursor {
                    None => self.waiting.iter().next(),
                    Some(c) => self.waiting.range((Excluded(c), Unbounded)).next(),
                };
                let Some((&key, &slot)) = next else { break };
                if (key.0 >= BACKGROUND_PRIORITY) != background {
                    break; // the queue is in key order: foreground first
                }
                if self.running.len() >= self.config.max_num_seqs {
                    // Every seat taken: a foreground request takes the newest background one's
                    // (not scheduled yet: background requests come after), else it waits.
                    let &(victim_key, _) = self.running.last().expect("max_num_seqs is at least 1");
                    if background || victim_key.0 < BACKGROUND_PRIORITY {
                        break;
                    }
                    self.preempt_last(&mut out.preempted_req_ids);
                }
                cursor = Some(key);
                let req = &mut self.requests[slot];
                if !lora_fits(&loras, req.namespace.adapter_id, max_loras) {
                    continue;
                }
                let hit = self.kv.match_prefix(req);
                // A hit that ends inside a block holds that block beside its copy while it is
                // copied: where the pool has no block for that, the hit's whole blocks (what the
                // request needs without any hit, or less).
                let whole = hit.whole_blocks(self.config.block_size);
                let mut admitted = None;
                for hit in [hit, whole] {
                    let cached = hit.num_tokens;
                    // A held request's limit is at least `cached`: the last prompt token is never a hit.
                    let num_new = (req.compute_limit() - cached).min(budget.min(prompt_budget));
                    let reaches_end = cached + num_new >= req.num_tokens();
                    let slots = cached + num_new + if reaches_end { lookahead } else { 0 };
                    if self.kv.allocate_slots(req, &hit, slots, &mut copies) {
                        admitted = Some((cached, num_new, reaches_end));
                        break;
                    }
                }
                let Some((cached, num_new, reaches_end)) = admitted else { break };
                req.num_computed_tokens = cached;
                if !req.admitted_once {
                    req.admitted_once = true;
                    req.num_cached_tokens = cached;
                    self.stats.prefix_cache_queries += req.num_tokens() as u64;
                    self.stats.prefix_cache_hits += cached as u64;
                }
                req.status = RequestStatus::Running;
                add_lora(&mut loras, req.namespace.adapter_id);
                self.waiting.remove(&key);
                insert_sorted(&mut self.running, (key, slot));
                if num_new == 0 {
                    // Held at its fork point by the cached prefix alone: running, nothing to compute.
                    self.fork_ready.push(req.id);
                    continue;
                }
                let s = ScheduledRequest {
                    id: req.id,
                    num_tokens: num_new,
                    num_spec_tokens: 0,
                    num_logits: usize::from(reaches_end),
                };
                plan.push((slot, s, cached));
                budget -= num_new;
                prompt_budget -= num_new;
                foreground_prompt |= !background;
            }
        }

        self.build_arrays(&mut out, &plan);
        out.block_copies = copies.into_iter().flatten().map(|b| b as i32).collect();
        out.finished_req_ids = std::mem::take(&mut self.finished_since_step);
        self.stats.num_preemptions += out.preempted_req_ids.len() as u64;
        self.stats.num_steps += 1;
        self.plan = plan;
        self.in_flight = true;
        Ok(out)
    }

    /// Takes the step's sampled tokens back: `num_sampled[i]` tokens per scheduled request, laid
    /// end to end in `sampled`. For a request that verified `k` drafts they are the accepted
    /// drafts then one bonus token; the KV of rejected drafts is given back. Requests that hit a
    /// stop token, `max_tokens` or the model length finish here and free their blocks.
    pub fn update(&mut self, sampled: &[u32], num_sampled: &[u32]) -> Result<UpdateResult> {
        if !self.in_flight {
            return Err(step_err("step", "no step in flight"));
        }
        self.check_step_result(sampled, num_sampled)?;
        self.in_flight = false;
        let plan = std::mem::take(&mut self.plan);
        let max_model_len = self.config.max_model_len;
        let mut result = UpdateResult {
            num_appended: Vec::with_capacity(plan.len()),
            req_ids: Vec::with_capacity(plan.len()),
            token_ids: Vec::with_capacity(sampled.len()),
            starts: Vec::with_capacity(plan.len() + 1),
            sampled_index: Vec::with_capacity(sampled.len()),
            fork_ready: std::mem::take(&mut self.fork_ready),
            ..Default::default()
        };
        result.starts.push(0);
        let mut finished_slots = Vec::new();
        let mut offset = 0;
        for (&(slot, s, _), &n) in plan.iter().zip(num_sampled) {
            let n = n as usize;
            let tokens = &sampled[offset..offset + n];
            offset += n;
            let req = match self.requests.get_mut(slot) {
                Some(req) if req.id == s.id && req.status == RequestStatus::Running => req,
                _ => {
                    result.num_appended.push(0);
                    continue;
                }
            };
            let mut appended = 0;
            let mut status = req.status;
            if n > 0 {
                if req.num_output_tokens() == 0 {
                    result.first_outputs.push((s.id, req.num_cached_tokens));
                }
                req.num_computed_tokens -= s.num_spec_tokens + 1 - n;
                req.clear_drafts();
                for &token in tokens {
                    result.token_ids.push(token);
                    result.sampled_index.push((offset - n + appended) as u32);
                    appended += 1;
                    status = req.append_token(token, max_model_len);
                    if status.is_finished() {
                        break;
                    }
                }
                result.req_ids.push(s.id);
                result.starts.push(result.token_ids.len() as u32);
            } else if req.hold_for_fork && req.num_computed_tokens + 1 == req.num_tokens() {
                result.fork_ready.push(s.id);
            }
            result.num_appended.push(appended as i32);
            self.kv.cache_full_blocks(req);
            if status.is_finished() {
                req.status = status;
                self.kv.free(req);
                result.finished.push((s.id, status.finish_reason().expect("finished")));
                finished_slots.push(slot);
            }
        }
        if !finished_slots.is_empty() {
            for &slot in &finished_slots {
                let req = self.requests.remove(slot);
                self.finished_since_step.push(req.id);
            }
            let requests = &self.requests;
            self.running.retain(|&(_, slot)| requests.get(slot).is_some());
        }
        self.plan = plan;
        Ok(result)
    }

    /// Lays out the flat arrays of the planned requests, in plan order, and advances each
    /// request's `num_computed_tokens` past its scheduled tokens.
    fn build_arrays(&mut self, out: &mut SchedulerOutput, plan: &[Planned]) {
        let bs = self.config.block_size;
        let (mut width, mut num_tokens) = (0, 0);
        for &(slot, s, _) in plan {
            width = width.max(self.requests[slot].block_table.len());
            num_tokens += s.num_tokens;
        }
        out.reserve(plan.len(), num_tokens, width);
        for &(slot, s, start) in plan {
            let req = &mut self.requests[slot];
            out.push_request(req, &s, start, bs, width);
            req.num_computed_tokens = start + s.num_tokens;
        }
    }

    /// The tokens requests computing a prompt may take in a step held to `token_budget`: what
    /// the running decodes leave of it, at least `block_size`; everything with no decodes.
    fn prompt_allowance(&self, token_budget: usize) -> usize {
        let max = self.config.max_num_batched_tokens;
        let decode_tokens: usize = self
            .running
            .iter()
            .map(|&(_, slot)| &self.requests[slot])
            .filter(|req| req.is_decoding())
            .map(|req| req.compute_limit().saturating_sub(req.num_computed_tokens))
            .sum();
        if decode_tokens == 0 {
            return max;
        }
        token_budget.min(max).saturating_sub(decode_tokens).max(self.config.block_size)
    }

    /// Preempts the last running request (the lowest priority, newest): its blocks are freed, its
    /// id joins `preempted`, and it waits at the head of its priority's queue.
    fn preempt_last(&mut self, preempted: &mut Vec<RequestId>) {
        let (_, slot) = self.running.pop().expect("a running request to preempt");
        let req = &mut self.requests[slot];
        preempted.push(req.id);
        self.kv.free(req);
        req.num_computed_tokens = 0;
        req.clear_drafts();
        req.status = RequestStatus::Preempted;
        req.num_preemptions += 1;
        req.order = self.next_head_order;
        self.next_head_order -= 1;
        self.waiting.insert(req.key(), slot);
    }

    fn check_step_result(&self, sampled: &[u32], num_sampled: &[u32]) -> Result<()> {
        let plan = &self.plan;
        if num_sampled.len() != plan.len() {
            return Err(step_err(
                "num_sampled",
                format!("{} entries for {} scheduled requests", num_sampled.len(), plan.len()),
            ));
        }
        let total: usize = num_sampled.iter().map(|&n| n as usize).sum();
        if total != sampled.len() {
            return Err(step_err(
                "sampled_token_ids",
                format!("{} tokens, num_sampled sums to {total}", sampled.len()),
            ));
        }
        for (&(slot, s, _), &n) in plan.iter().zip(num_sampled) {
            let live = self.requests.get(slot).is_some_and(|r| r.id == s.id);
            let n = n as usize;
            let ok =
                if live && s.num_logits > 0 { (1..=s.num_logits).contains(&n) } else { n <= s.num_logits };
            if !ok {
                return Err(step_err(
                    "num_sampled",
                    format!("request {} sampled {n} tokens at {} positions", s.id, s.num_logits),
                ));
            }
        }
        Ok(())
    }
}

fn lora_fits(loras: &[u32], adapter: u32, max_loras: usize) -> bool {
    adapter == 0 || loras.contains(&adapter) || loras.len() < max_loras
}

fn add_lora(loras: &mut Vec<u32>, adapter: u32) {
    if adapter != 0 && !loras.contains(&adapter) {
        loras.push(adapter);
    }
}
