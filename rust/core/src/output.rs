//! What one step hands to the model worker: plain data and flat arrays, no tensors.

use crate::request::{FinishReason, Request, RequestId};

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub id: RequestId,
    /// Tokens computed this step (a prefill chunk, one decode token, or one plus drafts).
    pub num_tokens: usize,
    /// How many of those are draft tokens to verify.
    pub num_spec_tokens: usize,
    /// Positions whose logits are sampled: 0 for a prompt chunk that does not reach the end,
    /// else `1 + num_spec_tokens`.
    pub num_logits: usize,
}

/// The result of [`crate::Scheduler::schedule`]. Arrays are indexed by scheduled request
/// (`req_ids` order) or by token (`input_ids` order); tokens of one request are contiguous.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerOutput {
    pub step: u64,
    pub req_ids: Vec<RequestId>,
    pub num_scheduled_tokens: Vec<i32>,
    pub num_spec_tokens: Vec<i32>,
    pub num_logits: Vec<i32>,
    /// Token index of each sampled position, grouped by request.
    pub logits_indices: Vec<i32>,
    /// `num_reqs + 1` offsets into the token axis.
    pub query_start_loc: Vec<i32>,
    /// Context length of each request after this step (cached prefix included).
    pub seq_lens: Vec<i32>,
    /// Output tokens each request had before this step (what penalties and `min_tokens` see).
    pub num_output_tokens: Vec<i32>,
    pub input_ids: Vec<i32>,
    /// Rotary position of each token: its index in the sequence, or for a draft of a token
    /// tree the request's last token's index plus the draft's depth.
    pub positions: Vec<i64>,
    /// Empty unless a scheduled request verifies a token tree; then per token the row (within
    /// its request's tokens of this step) of the token it follows, -1 for a request's first:
    /// a token attends to the request's tokens before this step and to its chain of parents.
    pub tree_parents: Vec<i32>,
    /// KV slot of each token: `block * block_size + offset`.
    pub slot_mapping: Vec<i64>,
    /// Row-major `[num_reqs, block_table_width]`, padded with the null block.
    pub block_tables: Vec<i32>,
    pub block_table_width: usize,
    /// Copy-on-write pairs `[src, dst]`, flattened: copy these blocks before the forward.
    pub block_copies: Vec<i32>,
    pub preempted_req_ids: Vec<RequestId>,
    /// Requests that finished or were aborted since the previous step: drop their state.
    pub finished_req_ids: Vec<RequestId>,
}

impl SchedulerOutput {
    pub fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }

    pub fn total_num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.req_ids.is_empty()
    }

    /// `tree_parents` of the first `n` tokens, a chain per request (each token follows the one
    /// before it), for a step whose first tree comes after them.
    fn fill_chain_parents(&mut self, n: usize) {
        let mut first = 0;
        for &end in &self.query_start_loc[1..] {
            let end = end as usize;
            self.tree_parents.extend((first..end).map(|t| (t - first) as i32 - 1));
            first = end;
        }
        debug_assert_eq!(self.tree_parents.len(), n);
    }

    /// Reserves room for `num_reqs` requests, `num_tokens` tokens and block tables `width` wide.
    pub(crate) fn reserve(&mut self, num_reqs: usize, num_tokens: usize, width: usize) {
        self.block_table_width = width;
        self.block_tables.reserve(num_reqs * width);
        for v in [
            &mut self.num_scheduled_tokens,
            &mut self.num_spec_tokens,
            &mut self.num_logits,
            &mut self.seq_lens,
            &mut self.num_output_tokens,
        ] {
            v.reserve(num_reqs);
        }
        self.req_ids.reserve(num_reqs);
        self.query_start_loc.reserve(num_reqs + 1);
        self.query_start_loc.push(0);
        self.input_ids.reserve(num_tokens);
        self.positions.reserve(num_tokens);
        self.slot_mapping.reserve(num_tokens);
        self.logits_indices.reserve(num_reqs);
    }

    /// Appends one request: its tokens (`start` is its `num_computed_tokens` before this step)
    /// and its block-table row padded to `width` with the null block.
    pub(crate) fn push_request(
        &mut self,
        req: &Request,
        s: &ScheduledRequest,
        start: usize,
        bs: usize,
        width: usize,
    ) {
        let first_token = self.input_ids.len();
        let known = req.token_ids.len();
        let tree = !req.spec_parents.is_empty();
        let depths = if tree { req.draft_depths() } else { Vec::new() };
        if tree && self.tree_parents.len() < first_token {
            self.fill_chain_parents(first_token);
        }
        for pos in start..start + s.num_tokens {
            let row = (pos - start) as i32;
            let (token, position) = if pos < known {
                (req.token_ids[pos], pos)
            } else if tree {
                (req.spec_token_ids[pos - known], known - 1 + depths[pos - known])
            } else {
                (req.spec_token_ids[pos - known], pos)
            };
            self.input_ids.push(token as i32);
            self.positions.push(position as i64);
            let block = req.block_table[pos / bs] as i64;
            self.slot_mapping.push(block * bs as i64 + (pos % bs) as i64);
            if tree && pos >= known {
                self.tree_parents.push((known - 1 - start) as i32 + req.spec_parents[pos - known] as i32);
            } else if !self.tree_parents.is_empty() || tree {
                self.tree_parents.push(row - 1);
            }
        }
        let end = first_token + s.num_tokens;
        self.logits_indices.extend((end - s.num_logits..end).map(|idx| idx as i32));
        self.req_ids.push(s.id);
        self.num_scheduled_tokens.push(s.num_tokens as i32);
        self.num_spec_tokens.push(s.num_spec_tokens as i32);
        self.num_logits.push(s.num_logits as i32);
        self.query_start_loc.push(end as i32);
        self.seq_lens.push((start + s.num_tokens) as i32);
        self.num_output_tokens.push(req.num_output_tokens() as i32);
        self.block_tables.extend(req.block_table.iter().map(|&b| b as i32));
        self.block_tables.extend(std::iter::repeat_n(0, width - req.block_table.len()));
    }
}

/// The result of [`crate::Scheduler::update`]: what the step produced, so the caller forwards
/// it instead of re-deriving it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateResult {
    /// Per scheduled request (`req_ids` order): how many of its sampled tokens were appended
    /// (fewer than sampled when it stopped early; 0 when it was aborted meanwhile).
    pub num_appended: Vec<i32>,
    pub finished: Vec<(RequestId, FinishReason)>,
    /// The requests that got tokens this step, in schedule order.
    pub req_ids: Vec<RequestId>,
    /// Their tokens end to end: `req_ids[i]` got `token_ids[starts[i]..starts[i + 1]]`.
    pub token_ids: Vec<u32>,
    pub starts: Vec<u32>,
    /// For each entry of `token_ids`, its index in the step's `sampled` tokens (tokens sampled
    /// after a stop are not appended, so the two differ once a stop lands inside drafts).
    pub sampled_index: Vec<u32>,
    /// `(id, num_cached_tokens)` of the requests that got their first output tokens this step.
    pub first_outputs: Vec<(RequestId, usize)>,
    /// Requests added with `hold_for_fork` whose prompt is computed up to its last token: fork
    /// their samples now, then [`crate::Scheduler::release_hold`].
    pub fork_ready: Vec<RequestId>,
}
