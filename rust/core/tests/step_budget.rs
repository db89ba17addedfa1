//! A step budget (`Scheduler::schedule_with_budget`): prompts computed while requests decode
//! take what the decodes leave of it; the decodes themselves are never held back.

mod common;

use common::{drafts_with, no_drafts, Driver};
use pyserve_core::{NewRequest, Scheduler, SchedulerConfig};

fn driver(max_num_batched_tokens: usize) -> Driver {
    let mut c = SchedulerConfig::new(256, 4);
    c.max_num_batched_tokens = max_num_batched_tokens;
    c.max_model_len = 256;
    Driver::new(Scheduler::new(c).unwrap())
}

fn req(id: u64, prompt_len: usize, max_tokens: usize) -> NewRequest {
    let mut r = NewRequest::new(id, (0..prompt_len as u32).map(|t| (t * 7 + id as u32) % 40).collect());
    r.max_tokens = Some(max_tokens);
    r
}

/// A driver whose requests `1..=n` are decoding (prefilled, one output token each).
fn decoding(n: u64, max_num_batched_tokens: usize) -> Driver {
    let mut d = driver(max_num_batched_tokens);
    for id in 1..=n {
        d.add(req(id, 4, 50)).unwrap();
    }
    d.step(no_drafts);
    d
}

#[test]
fn a_prompt_arriving_during_a_decode_is_chunked_to_the_budget() {
    let mut d = decoding(1, 64);
    d.token_budget = Some(10);
    d.add(req(2, 30, 5)).unwrap();
    let steps: Vec<Vec<i32>> = (0..5).map(|_| d.step(no_drafts).num_scheduled_tokens).collect();
    assert_eq!(steps, vec![vec![1, 9], vec![1, 9], vec![1, 9], vec![1, 3], vec![1, 1]]);
}

#[test]
fn the_budget_follows_each_step() {
    let mut d = decoding(1, 64);
    d.add(req(2, 40, 5)).unwrap();
    let mut chunks = Vec::new();
    for budget in [5, 21, 12] {
        d.token_budget = Some(budget);
        chunks.push(d.step(no_drafts).num_scheduled_tokens[1]);
    }
    assert_eq!(chunks, vec![4, 20, 11], "the prompt gets the budget less the decode token");
}

#[test]
fn without_decodes_a_prompt_gets_the_whole_step() {
    let mut d = driver(64);
    d.token_budget = Some(8);
    d.add(req(1, 40, 5)).unwrap();
    d.add(req(2, 30, 5)).unwrap();
    assert_eq!(d.step(no_drafts).num_scheduled_tokens, vec![40, 24], "max_num_batched_tokens only");
}

#[test]
fn a_budget_below_the_decodes_never_starves_them_and_prompts_still_progress() {
    let mut d = decoding(3, 64);
    d.token_budget = Some(2);
    d.add(req(4, 20, 5)).unwrap();
    assert_eq!(d.step(no_drafts).num_scheduled_tokens, vec![1, 1, 1, 4], "a block's worth for the prompt");
}

#[test]
fn drafts_count_as_decode_tokens() {
    let mut d = decoding(1, 64);
    d.step(|t| drafts_with(t, 3, 3)); // request 1 verifies 3 drafts at the next step
    d.token_budget = Some(12);
    d.add(req(2, 30, 5)).unwrap();
    let out = d.step(no_drafts);
    assert_eq!((out.num_spec_tokens, out.num_scheduled_tokens), (vec![3, 0], vec![4, 8]));
}

#[test]
fn the_budget_never_exceeds_max_num_batched_tokens() {
    let mut d = decoding(1, 16);
    d.token_budget = Some(1000);
    d.add(req(2, 40, 5)).unwrap();
    assert_eq!(d.step(no_drafts).num_scheduled_tokens, vec![1, 15]);
}
