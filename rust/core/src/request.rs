//! Per-request state as the scheduler sees it: tokens, progress, blocks, limits.

use crate::block_pool::BlockId;
use crate::radix::{Namespace, NodeId};

/// Caller-chosen request id, unique among live requests.
pub type RequestId = u64;

/// Lifecycle of a request. Ordered: everything from `FinishedStopped` on is finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RequestStatus {
    Waiting,
    Running,
    Preempted,
    FinishedStopped,
    FinishedLength,
    FinishedAborted,
}

impl RequestStatus {
    pub fn is_finished(self) -> bool {
        self >= RequestStatus::FinishedStopped
    }

    pub fn finish_reason(self) -> Option<FinishReason> {
        match self {
            RequestStatus::FinishedStopped => Some(FinishReason::Stop),
            RequestStatus::FinishedLength => Some(FinishReason::Length),
            RequestStatus::FinishedAborted => Some(FinishReason::Abort),
            _ => None,
        }
    }
}

/// Why a request ended; the integer values cross the FFI boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FinishReason {
    /// An EOS or stop token was sampled.
    Stop = 0,
    /// `max_tokens` or the model length was reached.
    Length = 1,
    /// Aborted by the caller.
    Abort = 2,
}

/// Everything needed to admit a request. `max_tokens: None` means "up to the model length".
#[derive(Debug, Clone, Default)]
pub struct NewRequest {
    pub id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: Option<usize>,
    pub min_tokens: usize,
    /// Lower values are served first (vLLM's convention); ties go to the earlier arrival.
    pub priority: i32,
    pub namespace: Namespace,
    pub stop_token_ids: Vec<u32>,
    pub eos_token_id: Option<u32>,
    pub ignore_eos: bool,
    /// Its other samples will fork from it (`n > 1`): prefill stops one token short of the
    /// prompt until [`crate::Scheduler::release_hold`], so the forks share every computed block.
    pub hold_for_fork: bool,
}

impl NewRequest {
    pub fn new(id: RequestId, prompt_token_ids: Vec<u32>) -> Self {
        Self { id, prompt_token_ids, ..Default::default() }
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub namespace: Namespace,
    pub priority: i32,
    /// Tie-break within a priority: arrival order, negative for preempted requests so they go
    /// back to the head of the queue.
    pub(crate) order: i64,
    pub status: RequestStatus,
    /// Prompt followed by every accepted output token.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose KV is written (after a step is scheduled it counts the scheduled tokens;
    /// rejected draft tokens are taken back in `update`).
    pub num_computed_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub num_cached_tokens: usize,
    /// Draft tokens proposed for the next step.
    pub spec_token_ids: Vec<u32>,
    /// Empty for a chain of drafts (each follows the one before); for a token tree, each
    /// draft's parent: 0 for the request's last token, `j` for draft `j - 1` (before it).
    pub spec_parents: Vec<u32>,
    pub block_table: Vec<BlockId>,
    /// Leading blocks of `block_table` already inserted in the prefix cache.
    pub(crate) num_inserted_blocks: usize,
    /// Tree node of the last inserted block, where the next insert resumes.
    pub(crate) cache_node: Option<NodeId>,
    /// Set on both sides of a fork until the request's blocks are freed: only then may its
    /// partly filled block be shared, so only then is copy-on-write checked.
    pub(crate) forked: bool,
    pub num_preemptions: u32,
    pub(crate) admitted_once: bool,
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub eos_token_id: Option<u32>,
    pub ignore_eos: bool,
    /// See [`NewRequest::hold_for_fork`].
    pub hold_for_fork: bool,
}

impl Request {
    pub(crate) fn from_new(new: NewRequest, max_tokens: usize, order: i64) -> Self {
        Self {
            id: new.id,
            namespace: new.namespace,
            priority: new.priority,
            order,
            status: RequestStatus::Waiting,
            num_prompt_tokens: new.prompt_token_ids.len(),
            token_ids: new.prompt_token_ids,
            num_computed_tokens: 0,
            num_cached_tokens: 0,
            spec_token_ids: Vec::new(),
            spec_parents: Vec::new(),
            block_table: Vec::new(),
            num_inserted_blocks: 0,
            cache_node: None,
            forked: false,
            num_preemptions: 0,
            admitted_once: false,
            max_tokens,
            min_tokens: new.min_tokens,
            stop_token_ids: new.stop_token_ids,
            eos_token_id: new.eos_token_id,
            ignore_eos: new.ignore_eos,
            hold_for_fork: new.hold_for_fork,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// The token count its computation may reach now: its tokens and drafts, or, while held for
    /// a fork, all but the last prompt token.
    pub(crate) fn compute_limit(&self) -> usize {
        if self.hold_for_fork {
            self.num_tokens() - 1
        } else {
            self.num_tokens() + self.spec_token_ids.len()
        }
    }

    /// Caught up with its tokens after producing output: a step computes only its last token
    /// and its drafts.
    pub(crate) fn is_decoding(&self) -> bool {
        self.num_output_tokens() > 0
            && self.compute_limit().saturating_sub(self.num_computed_tokens) <= 1 + self.spec_token_ids.len()
    }

    /// Drops the drafts (tokens and tree).
    pub(crate) fn clear_drafts(&mut self) {
        self.spec_token_ids.clear();
        self.spec_parents.clear();
    }

    /// Keeps the first `n` drafts (a tree's first drafts are a tree: parents come first).
    pub(crate) fn truncate_drafts(&mut self, n: usize) {
        self.spec_token_ids.truncate(n);
        self.spec_parents.truncate(n);
    }

    /// Each draft's depth below the request's last token (1 for its children).
    pub(crate) fn draft_depths(&self) -> Vec<usize> {
        let mut depths: Vec<usize> = Vec::with_capacity(self.spec_token_ids.len());
        for j in 0..self.spec_token_ids.len() {
            let parent = self.spec_parents.get(j).map_or(j, |&p| p as usize);
            depths.push(if parent == 0 { 1 } else { depths[parent - 1] + 1 });
        }
        depths
    }

    /// Queue key: lower sorts first.
    pub(crate) fn key(&self) -> (i32, i64) {
        (self.priority, self.order)
    }

    /// Appends one accepted token and returns the status it leaves the request in.
    pub(crate) fn append_token(&mut self, token: u32, max_model_len: usize) -> RequestStatus {
        self.token_ids.push(token);
        let n_out = self.num_output_tokens();
        if n_out >= self.min_tokens
            && ((!self.ignore_eos && self.eos_token_id == Some(token))
                || self.stop_token_ids.contains(&token))
        {
            return RequestStatus::FinishedStopped;
        }
        if n_out >= self.max_tokens || self.token_ids.len() >= max_model_len {
            return RequestStatus::FinishedLength;
        }
        self.status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(max_tokens: usize, min_tokens: usize, eos: Option<u32>, stop: Vec<u32>) -> Request {
        let new = NewRequest {
            min_tokens,
            eos_token_id: eos,
            stop_token_ids: stop,
            ..NewRequest::new(1, vec![5, 6])
        };
        Request::from_new(new, max_tokens, 0)
    }

    #[test]
    fn a_stop_token_ends_the_request_only_from_min_tokens_on() {
        let mut r = request(10, 2, Some(9), vec![7]);
        assert_eq!(r.append_token(9, 100), RequestStatus::Waiting, "EOS before min_tokens is a token");
        assert_eq!(r.append_token(7, 100), RequestStatus::FinishedStopped);
        assert_eq!(r.num_output_tokens(), 2);
    }

    #[test]
    fn max_tokens_and_the_model_length_end_it_with_length() {
        let mut r = request(2, 0, None, vec![]);
        assert_eq!(r.append_token(3, 100), RequestStatus::Waiting);
        assert_eq!(r.append_token(3, 100), RequestStatus::FinishedLength);
        let mut r = request(10, 0, None, vec![]);
        assert_eq!(r.append_token(3, 3), RequestStatus::FinishedLength, "prompt 2 + 1 token reach length 3");
    }

    #[test]
    fn a_held_request_may_compute_all_but_its_last_prompt_token() {
        let mut r = request(4, 0, None, vec![]);
        r.spec_token_ids = vec![1, 2];
        assert_eq!(r.compute_limit(), 4);
        r.hold_for_fork = true;
        assert_eq!(r.compute_limit(), 1);
    }
}
