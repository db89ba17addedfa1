//! One step: `schedule` decides who runs and builds the flat arrays; `update` takes the
//! sampled tokens back, rolls back rejected drafts and finishes requests.

use std::ops::Bound::{Excluded, Unbounded};

use super::{insert_sorted, QueueKey, Scheduler};
use crate::error::{step_err, Result};
use crate::output::{ScheduledRequest, SchedulerOutput, UpdateResult};
use crate::request::{RequestId, RequestStatus};

impl Scheduler {
    /// Decides one step. Call [`Self::update`] with its results before the next `schedule`.
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        if self.in_flight.is_some() {
            return Err(step_err("step", "the previous step has not been updated"));
        }
        let cfg = self.config.clone();
        let bs = cfg.block_size;
        let mut budget = cfg.max_num_batched_tokens;
        let mut plan: Vec<(ScheduledRequest, usize)> = Vec::new();
        let mut loras: Vec<u32> = Vec::new();
        let mut copies = Vec::new();
        let mut out = SchedulerOutput { step: self.stats.num_steps, ..Default::default() };

        // Running requests, in queue order; victims are taken from the back.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i].1;
            let req = self.requests.get_mut(&id).expect("running request is live");
            let wanted = req.num_tokens() + req.spec_token_ids.len() - req.num_computed_tokens;
            let num_new = wanted.min(budget);
            if num_new == 0 || !lora_fits(&loras, req.namespace.adapter_id, cfg.max_loras) {
                i += 1;
                continue;
            }
            let start = req.num_computed_tokens;
            let reaches_end = start + num_new >= req.num_tokens();
            let slots = start + num_new + if reaches_end { cfg.num_lookahead_tokens } else { 0 };
            let mut scheduled = true;
            while !self.kv.can_allocate(&self.requests[&id], &[], slots) {
                let (_, victim) = self.running.pop().expect("the request itself is running");
                self.preempt(victim);
                out.preempted_req_ids.push(victim);
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            let req = self.requests.get_mut(&id).expect("running request is live");
            let allocated = self.kv.allocate_slots(req, &[], slots, &mut copies);
            debug_assert!(allocated);
            let num_spec = (start + num_new).saturating_sub(req.num_tokens());
            req.spec_token_ids.truncate(num_spec);
            let num_logits = if reaches_end { 1 + num_spec } else { 0 };
            plan.push((
                ScheduledRequest { id, num_tokens: num_new, num_spec_tokens: num_spec, num_logits },
                start,
            ));
            add_lora(&mut loras, req.namespace.adapter_id);
            budget -= num_new;
            i += 1;
        }

        // Waiting requests, only when nothing had to be preempted.
        let mut cursor: Option<QueueKey> = None;
        while out.preempted_req_ids.is_empty() && budget > 0 && self.running.len() < cfg.max_num_seqs {
            let next = match cursor {
                None => self.waiting.iter().next(),
                Some(c) => self.waiting.range((Excluded(c), Unbounded)).next(),
            };
            let Some((&key, &id)) = next else { break };
            cursor = Some(key);
            let req = self.requests.get_mut(&id).expect("waiting request is live");
            if !lora_fits(&loras, req.namespace.adapter_id, cfg.max_loras) {
                continue;
            }
            let hits = self.kv.match_prefix(req);
            let cached = hits.len() * bs;
            let num_new = (req.num_tokens() - cached).min(budget);
            let reaches_end = cached + num_new >= req.num_tokens();
            let slots = cached + num_new + if reaches_end { cfg.num_lookahead_tokens } else { 0 };
            if !self.kv.allocate_slots(req, &hits, slots, &mut copies) {
                break;
            }
            req.num_computed_tokens = cached;
            if !req.admitted_once {
                req.admitted_once = true;
                req.num_cached_tokens = cached;
                self.stats.prefix_query_tokens += req.num_tokens() as u64;
                self.stats.prefix_hit_tokens += cached as u64;
            }
            req.status = RequestStatus::Running;
            self.waiting.remove(&key);
            insert_sorted(&mut self.running, (key, id));
            let num_logits = usize::from(reaches_end);
            plan.push((ScheduledRequest { id, num_tokens: num_new, num_spec_tokens: 0, num_logits }, cached));
            add_lora(&mut loras, req.namespace.adapter_id);
            budget -= num_new;
        }

        for (s, start) in &plan {
            let req = self.requests.get_mut(&s.id).expect("scheduled request is live");
            out.push_request(req, s, *start, bs);
            req.num_computed_tokens = start + s.num_tokens;
        }
        let requests = &self.requests;
        out.set_block_tables(plan.iter().map(|(s, _)| requests[&s.id].block_table.as_slice()));
        out.block_copies = copies.into_iter().flatten().map(|b| b as i32).collect();
        out.finished_req_ids = std::mem::take(&mut self.finished_since_step);
        self.stats.num_preemptions += out.preempted_req_ids.len() as u64;
        self.in_flight = Some((out.step, plan.into_iter().map(|(s, _)| s).collect()));
        self.stats.num_steps += 1;
        Ok(out)
    }

    /// Takes the step's sampled tokens back: `num_sampled[i]` tokens per scheduled request, laid
    /// end to end in `sampled`. For a request that verified `k` drafts they are the accepted
    /// drafts then one bonus token; the KV of rejected drafts is given back. Requests hit a stop
    /// token, `max_tokens` or the model length finish here and free their blocks.
    pub fn update(&mut self, sampled: &[u32], num_sampled: &[u32]) -> Result<UpdateResult> {
        let (step, plan) = self.in_flight.take().ok_or_else(|| step_err("step", "no step in flight"))?;
        if let Err(e) = self.check_step_result(&plan, sampled, num_sampled) {
            self.in_flight = Some((step, plan));
            return Err(e);
        }
        let max_model_len = self.config.max_model_len;
        let mut result = UpdateResult { num_appended: Vec::with_capacity(plan.len()), finished: Vec::new() };
        let mut offset = 0;
        for (s, &n) in plan.iter().zip(num_sampled) {
            let n = n as usize;
            let tokens = &sampled[offset..offset + n];
            offset += n;
            let req = match self.requests.get_mut(&s.id) {
                Some(req) if req.status == RequestStatus::Running => req,
                _ => {
                    result.num_appended.push(0);
                    continue;
                }
            };
            let mut appended = 0;
            let mut status = req.status;
            if n > 0 {
                req.num_computed_tokens -= s.num_spec_tokens + 1 - n;
                req.spec_token_ids.clear();
                for &token in tokens {
                    appended += 1;
                    status = req.append_token(token, max_model_len);
                    if status.is_finished() {
                        break;
                    }
                }
            }
            result.num_appended.push(appended);
            self.kv.cache_full_blocks(req);
            if status.is_finished() {
                req.status = status;
                self.kv.free(req);
                result.finished.push((s.id, status.finish_reason().expect("finished")));
            }
        }
        if !result.finished.is_empty() {
            for &(id, _) in &result.finished {
                self.requests.remove(&id);
                self.finished_since_step.push(id);
            }
            let requests = &self.requests;
            self.running.retain(|(_, id)| requests.contains_key(id));
        }
        Ok(result)
    }

    fn preempt(&mut self, id: RequestId) {
        let req = self.requests.get_mut(&id).expect("preempted request is live");
        self.kv.free(req);
        req.num_computed_tokens = 0;
        req.spec_token_ids.clear();
        req.status = RequestStatus::Preempted;
        req.num_preemptions += 1;
        req.order = self.next_head_order;
        self.next_head_order -= 1;
        self.waiting.insert(req.key(), id);
    }

    fn check_step_result(
        &self,
        plan: &[ScheduledRequest],
        sampled: &[u32],
        num_sampled: &[u32],
    ) -> Result<()> {
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
        for (s, &n) in plan.iter().zip(num_sampled) {
            let live = self.requests.contains_key(&s.id);
            let ok = if live && s.num_logits > 0 {
                (1..=s.num_logits).contains(&(n as usize))
            } else {
                n as usize <= s.num_logits
            };
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
