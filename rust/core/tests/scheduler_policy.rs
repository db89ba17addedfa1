//! The scheduling policy, pinned case by case (background work: background_work.rs).

mod common;

use common::{config, next_token, no_drafts, reference_output, req, Driver};
use pyserve_core::{CoreError, FinishReason, Namespace, RequestStatus, Scheduler, SchedulerConfig};

#[test]
fn long_prompt_is_chunked_to_the_budget() {
    let mut d = Driver::new(Scheduler::new(config(64, 4, 8)).unwrap());
    d.add(req(1, (0..20).collect(), 2)).unwrap();
    let chunks: Vec<Vec<i32>> = (0..3).map(|_| d.step(no_drafts).num_scheduled_tokens).collect();
    assert_eq!(chunks, vec![vec![8], vec![8], vec![4]]);
    assert_eq!(d.sched.request(1).unwrap().num_output_tokens(), 1, "only the last chunk samples");
}

#[test]
fn cached_prefix_is_not_recomputed() {
    let mut d = Driver::new(Scheduler::new(config(64, 4, 64)).unwrap());
    let prompt: Vec<u32> = (0..18).collect();
    d.add(req(1, prompt.clone(), 1)).unwrap();
    d.run_to_end(10, no_drafts);
    let mut other = prompt[..13].to_vec();
    other.extend([30, 31]);
    d.add(req(2, other, 1)).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.num_scheduled_tokens, vec![2], "13 of 15 tokens come from the cache");
    assert_eq!(out.positions, vec![13, 14]);
    assert_eq!(d.sched.stats().prefix_cache_hits, 13);
    // Three whole blocks shared, and the fourth (tokens 12..16) copied: its first token matches.
    assert_eq!(out.block_copies.len(), 2, "one [src, dst] pair");
    assert_ne!(out.block_copies[0], out.block_copies[1]);
    d.run_to_end(10, no_drafts);
    let prompt2: Vec<u32> = (0..13).chain([30, 31]).collect();
    assert_eq!(d.finished[&2], reference_output(&prompt2, 1, None));
}

#[test]
fn a_hit_inside_a_block_gives_way_to_its_whole_blocks_where_the_pool_cannot_hold_its_copy() {
    // Four usable blocks of 4. The second prompt shares 13 tokens with the first: its hit ends a
    // token into the fourth block, whose copy would need a fifth block beside the four held.
    let mut d = Driver::new(Scheduler::new(config(5, 4, 64)).unwrap());
    let prompt: Vec<u32> = (0..15).collect();
    d.add(req(1, prompt.clone(), 1)).unwrap();
    d.run_to_end(10, no_drafts);
    let other: Vec<u32> = (0..13).chain([30, 31]).collect();
    d.add(req(2, other.clone(), 1)).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.num_scheduled_tokens, vec![3], "the three whole blocks (12 tokens) come from the cache");
    assert!(out.block_copies.is_empty());
    d.run_to_end(10, no_drafts);
    assert_eq!(d.finished[&2], reference_output(&other, 1, None));
}

#[test]
fn a_next_turn_finds_every_computed_token_of_the_last_one() {
    let mut d = Driver::new(Scheduler::new(config(64, 4, 64)).unwrap());
    let prompt: Vec<u32> = (0..10).collect();
    d.add(req(1, prompt.clone(), 2)).unwrap();
    d.run_to_end(10, no_drafts);
    // 12 tokens, 11 computed (the last output never is): two full blocks and 3 tokens of a third.
    let mut next = [prompt, d.finished[&1].0.clone()].concat();
    next.extend([40, 41]);
    d.add(req(2, next, 1)).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.num_scheduled_tokens, vec![3], "11 of 14 tokens come from the cache");
    assert_eq!(d.sched.stats().prefix_cache_hits, 11);
    assert_eq!(out.block_copies.len(), 2, "the tail block, copied");
}

#[test]
fn adapters_and_salts_do_not_share_prefixes() {
    let mut d = Driver::new(Scheduler::new(config(64, 4, 64)).unwrap());
    let prompt: Vec<u32> = (0..9).collect();
    d.add(req(1, prompt.clone(), 1)).unwrap();
    d.run_to_end(10, no_drafts);
    for (id, ns) in
        [(2, Namespace::new(1, "")), (3, Namespace::new(0, "tenant-b")), (4, Namespace::default())]
    {
        let mut r = req(id, prompt.clone(), 1);
        r.namespace = ns;
        d.add(r).unwrap();
        let out = d.step(no_drafts);
        d.run_to_end(10, no_drafts);
        let expected = if id == 4 { 1 } else { 9 };
        assert_eq!(out.num_scheduled_tokens, vec![expected], "request {id}");
    }
}

#[test]
fn preemption_takes_lowest_priority_then_newest_and_requeues_at_head() {
    // 6 usable blocks of 2 tokens; three requests of 4 prompt tokens each hold 2 blocks.
    let mut c = config(7, 2, 64);
    c.enable_prefix_caching = false;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    for (id, prio) in [(1, 0), (2, 1), (3, 0)] {
        let mut r = req(id, vec![id as u32; 4], 8);
        r.priority = prio;
        d.add(r).unwrap();
    }
    d.step(no_drafts); // all three prefilled: 6 blocks held
    let out = d.step(no_drafts); // position 4 needs a third block each: the pool is empty
    assert_eq!(out.preempted_req_ids, vec![2], "priority 1 goes first");
    assert_eq!(out.req_ids, vec![1, 3]);
    d.add(req(4, vec![9; 3], 2)).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.req_ids, vec![1, 3], "2 is at the head and does not fit; 4 waits behind it");
    let state = d.sched.request(2).unwrap();
    assert_eq!(
        (state.status, state.num_computed_tokens, state.num_preemptions),
        (RequestStatus::Preempted, 0, 1)
    );
    d.run_to_end(100, no_drafts);
    assert_eq!(d.finished.len(), 4);
    for (id, (tokens, _)) in &d.finished {
        assert!(!tokens.is_empty(), "request {id}");
    }
}

#[test]
fn preempted_request_runs_before_later_arrivals() {
    let mut c = config(5, 2, 64);
    c.enable_prefix_caching = false;
    c.max_num_seqs = 1;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    d.add(req(1, vec![1; 3], 4)).unwrap();
    d.add(req(2, vec![2; 3], 4)).unwrap();
    let mut first_steps = Vec::new();
    while d.sched.has_unfinished_requests() {
        let out = d.step(no_drafts);
        first_steps.extend(out.req_ids);
    }
    first_steps.dedup();
    assert_eq!(first_steps, vec![1, 2]);
}

#[test]
fn lora_cap_limits_distinct_adapters_per_step() {
    let mut c = config(64, 4, 256);
    c.max_loras = 2;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    for (id, adapter) in [(1, 1), (2, 2), (3, 3), (4, 0), (5, 1)] {
        let mut r = req(id, vec![id as u32; 5], 3);
        r.namespace = Namespace::new(adapter, "");
        d.add(r).unwrap();
    }
    let out = d.step(no_drafts);
    assert_eq!(out.req_ids, vec![1, 2, 4, 5], "adapter 3 waits for a free slot");
    d.run_to_end(20, no_drafts);
    assert_eq!(d.finished.len(), 5);
}

#[test]
fn lora_requests_are_refused_when_adapters_are_disabled() {
    let mut c = config(64, 4, 64);
    c.max_loras = 0;
    let mut s = Scheduler::new(c).unwrap();
    let mut r = req(1, vec![1, 2], 3);
    r.namespace = Namespace::new(5, "");
    assert!(matches!(s.add_request(r), Err(CoreError::InvalidRequest { field: "adapter_id", .. })));
}

#[test]
fn lookahead_slots_and_rejected_drafts_are_rolled_back() {
    let mut c = config(64, 4, 64);
    c.num_lookahead_tokens = 3;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    d.add(req(1, vec![5, 6, 7], 20)).unwrap();
    let out = d.step(no_drafts);
    // 3 prompt tokens + 3 lookahead slots = 2 blocks.
    assert_eq!(out.block_table_width, 2);
    let tokens = d.live[&1].tokens.clone();
    let good = next_token(&tokens);
    let mut seq = tokens.clone();
    seq.push(good);
    let wrong = (next_token(&seq) + 1) % common::VOCAB;
    d.sched.set_spec_tokens(1, &[good, wrong, 0]).unwrap();
    d.live.get_mut(&1).unwrap().drafts = vec![good, wrong, 0];
    let out = d.step(no_drafts);
    assert_eq!(out.num_spec_tokens, vec![3]);
    assert_eq!(out.num_logits, vec![4]);
    assert_eq!(out.num_scheduled_tokens, vec![4]);
    let state = d.sched.request(1).unwrap();
    // One draft accepted plus the bonus token: 4 + 2 = 6 tokens, KV for the first 5.
    assert_eq!((state.num_tokens(), state.num_computed_tokens), (6, 5));
}

#[test]
fn drafts_never_exceed_max_tokens() {
    let mut d = Driver::new(Scheduler::new(config(64, 4, 64)).unwrap());
    d.add(req(1, vec![1, 2, 3], 3)).unwrap();
    d.step(no_drafts);
    d.sched.set_spec_tokens(1, &[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(d.sched.request(1).unwrap().spec_token_ids.len(), 2);
}

#[test]
fn abort_frees_blocks_anywhere() {
    let mut c = config(16, 4, 8);
    c.enable_prefix_caching = false;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    d.add(req(1, (0..20).collect(), 4)).unwrap();
    d.add(req(2, vec![1, 2], 4)).unwrap();
    d.step(no_drafts);
    assert!(d.sched.stats().kv_cache_usage_perc > 0.0);
    d.abort(1);
    d.abort(2);
    d.sched.check_invariants().unwrap();
    let stats = d.sched.stats();
    assert_eq!((stats.kv_cache_usage_perc, stats.kv_free_blocks), (0.0, 15));
    assert_eq!(d.sched.schedule().unwrap().finished_req_ids, vec![1, 2]);
    assert_eq!(d.sched.abort(1), Err(CoreError::UnknownRequest(1)));
}

#[test]
fn fork_shares_blocks_and_copies_on_write() {
    let mut c = config(32, 4, 64);
    c.enable_prefix_caching = false;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    d.add(req(1, (0..6).collect(), 4)).unwrap();
    d.step(no_drafts);
    d.fork(1, 2);
    let (a, b) =
        (d.sched.request(1).unwrap().block_table.clone(), d.sched.request(2).unwrap().block_table.clone());
    assert_eq!(a[..2], b[..2], "the prompt's blocks are shared");
    let out = d.step(no_drafts);
    // Both write position 6, in the shared half-full block 1: one of them copies it first.
    assert_eq!(out.block_copies.len(), 2);
    assert_eq!(out.block_copies[0], a[1] as i32);
    d.run_to_end(20, no_drafts);
    assert_eq!(d.finished[&1], d.finished[&2]);
}

#[test]
fn a_held_request_computes_its_prompt_once_for_all_its_forks() {
    for caching in [false, true] {
        let mut c = config(64, 4, 64);
        c.enable_prefix_caching = caching;
        let mut d = Driver::new(Scheduler::new(c).unwrap());
        let prompt: Vec<u32> = (0..10).collect();
        let mut r = req(1, prompt.clone(), 5);
        r.hold_for_fork = true;
        d.add(r).unwrap();
        let out = d.step(no_drafts);
        assert_eq!((out.num_scheduled_tokens.clone(), out.num_logits.clone()), (vec![9], vec![0]));
        assert_eq!(d.last.fork_ready, vec![1]);
        d.fork(1, 2);
        d.fork(1, 3);
        d.sched.release_hold(1).unwrap();
        let out = d.step(no_drafts);
        // Each sample computes only the last prompt token, into its own copy of the shared block.
        assert_eq!(out.num_scheduled_tokens, vec![1, 1, 1]);
        assert_eq!(out.block_copies.len(), 4);
        assert_eq!(d.last.first_outputs, vec![(1, 0), (2, 0), (3, 0)]);
        d.run_to_end(20, no_drafts);
        let expected = reference_output(&prompt, 5, None);
        for id in 1..=3 {
            assert_eq!(d.finished[&id], expected, "caching {caching}, sample {id}");
        }
    }
}

#[test]
fn a_held_request_whose_prompt_is_cached_forks_at_admission() {
    let mut d = Driver::new(Scheduler::new(config(64, 4, 64)).unwrap());
    let prompt: Vec<u32> = (0..9).collect();
    d.add(req(1, prompt.clone(), 2)).unwrap();
    d.run_to_end(10, no_drafts);
    let mut r = req(2, prompt, 2);
    r.hold_for_fork = true;
    d.add(r).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.num_reqs(), 0, "8 of 9 prompt tokens are cached: nothing to compute before the fork");
    assert_eq!(d.last.fork_ready, vec![2]);
    d.fork(2, 3);
    d.sched.release_hold(2).unwrap();
    assert_eq!(d.step(no_drafts).num_scheduled_tokens, vec![1, 1]);
    assert_eq!(d.last.first_outputs, vec![(2, 8), (3, 8)]);
    d.run_to_end(10, no_drafts);
    assert_eq!(d.finished[&2], d.finished[&1]);
    assert_eq!(d.finished[&3], d.finished[&1]);
}

#[test]
fn stop_tokens_respect_min_tokens_and_ignore_eos() {
    let prompt = vec![1u32, 2, 3];
    let first = next_token(&prompt);
    let cases = [
        (0, false, 1, FinishReason::Stop),
        (2, false, 2, FinishReason::Stop),
        (0, true, 4, FinishReason::Length),
    ];
    for (min_tokens, ignore_eos, len, reason) in cases {
        let mut d = Driver::new(Scheduler::new(config(64, 4, 64)).unwrap());
        let mut r = req(1, prompt.clone(), 4);
        r.eos_token_id = Some(first);
        r.min_tokens = min_tokens;
        r.ignore_eos = ignore_eos;
        // Sample the EOS token at every step, straight through the core.
        d.sched.add_request(r).unwrap();
        let mut got = Vec::new();
        let mut finish = None;
        while finish.is_none() {
            let out = d.sched.schedule().unwrap();
            let res = d.sched.update(&vec![first; out.num_reqs()], &vec![1; out.num_reqs()]).unwrap();
            got.push(first);
            finish = res.finished.first().map(|f| f.1);
        }
        assert_eq!(
            (got.len(), finish.unwrap()),
            (len, reason),
            "min_tokens={min_tokens} ignore_eos={ignore_eos}"
        );
    }
}

#[test]
fn requests_that_can_never_fit_are_refused() {
    let mut s = Scheduler::new(config(5, 4, 64)).unwrap(); // 16 tokens of KV
    let err = |r| match r {
        Err(CoreError::InvalidRequest { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(err(s.add_request(req(1, vec![1; 10], 7))), "max_tokens");
    assert_eq!(err(s.add_request(req(1, vec![1; 17], 1))), "prompt_token_ids"); // alone over the 16-token pool
    assert_eq!(err(s.add_request(req(1, vec![], 7))), "prompt_token_ids");
    assert_eq!(err(s.add_request(req(1, vec![1; 256], 1))), "prompt_token_ids");
    assert_eq!(err(s.add_request(req(1, vec![1; 10], 0))), "max_tokens");
    let mut r = req(1, vec![1; 3], 2);
    r.min_tokens = 3;
    assert_eq!(err(s.add_request(r)), "min_tokens");
    s.add_request(req(1, vec![1; 10], 6)).unwrap();
    assert_eq!(err(s.add_request(req(1, vec![1; 2], 1))), "request_id");
}

#[test]
fn bad_configs_name_the_field() {
    let field = |c: SchedulerConfig| match Scheduler::new(c) {
        Err(CoreError::InvalidConfig { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(field(SchedulerConfig::new(1, 16)), "num_blocks");
    assert_eq!(field(SchedulerConfig::new(8, 12)), "block_size");
    assert_eq!(field(SchedulerConfig::new(8, 0)), "block_size");
    assert_eq!(field(config(8, 16, 8)), "max_num_batched_tokens");
    let mut c = config(8, 4, 8);
    c.max_num_seqs = 0;
    assert_eq!(field(c), "max_num_seqs");
}

#[test]
fn update_rejects_mismatched_results_and_keeps_the_step() {
    let mut s = Scheduler::new(config(64, 4, 64)).unwrap();
    s.add_request(req(1, vec![1, 2, 3], 2)).unwrap();
    assert!(matches!(s.update(&[], &[]), Err(CoreError::InvalidStepResult { field: "step", .. })));
    s.schedule().unwrap();
    assert!(matches!(s.schedule(), Err(CoreError::InvalidStepResult { field: "step", .. })));
    assert!(matches!(
        s.update(&[1, 2], &[2]),
        Err(CoreError::InvalidStepResult { field: "num_sampled", .. })
    ));
    assert!(matches!(
        s.update(&[1], &[1, 1]),
        Err(CoreError::InvalidStepResult { field: "num_sampled", .. })
    ));
    assert!(matches!(
        s.update(&[1, 1], &[1]),
        Err(CoreError::InvalidStepResult { field: "sampled_token_ids", .. })
    ));
    assert_eq!(s.update(&[7], &[1]).unwrap().num_appended, vec![1]);
}

/// A scheduler (blocks of 4, no prefix cache) whose requests (id, prompt, max_tokens) have
/// computed their prompts and got `first` as their first tokens: each decodes from here.
fn decoding(requests: &[(u64, Vec<u32>, usize)], first: &[u32]) -> Scheduler {
    let mut c = config(32, 4, 64);
    c.enable_prefix_caching = false;
    let mut s = Scheduler::new(c).unwrap();
    for (id, prompt, max_tokens) in requests {
        s.add_request(req(*id, prompt.clone(), *max_tokens)).unwrap();
    }
    s.schedule().unwrap();
    s.update(first, &vec![1; first.len()]).unwrap();
    s
}

#[test]
fn a_token_tree_takes_slots_in_order_and_positions_by_depth() {
    // Tokens 5 6 7 10 and 8 9 11.
    let mut s = decoding(&[(1, vec![5, 6, 7], 16), (2, vec![8, 9], 16)], &[10, 11]);
    // Request 1's tree: 20 and 21 follow its last token, 22 follows 20, 23 follows 22, 24
    // follows 21. Request 2 verifies a chain.
    s.set_spec_tree(1, &[20, 21, 22, 23, 24], &[0, 0, 1, 3, 2]).unwrap();
    s.set_spec_tokens(2, &[30, 31]).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.input_ids, vec![10, 20, 21, 22, 23, 24, 11, 30, 31]);
    assert_eq!(out.positions, vec![3, 4, 4, 5, 6, 5, 2, 3, 4]);
    assert_eq!(out.tree_parents, vec![-1, 0, 0, 1, 3, 2, -1, 0, 1]);
    let slots: Vec<i64> = out.slot_mapping[..6].iter().map(|&x| x % 4).collect();
    assert_eq!(slots, vec![3, 0, 1, 2, 3, 0]); // one slot a row, in row order
    assert_eq!(out.num_logits, vec![6, 3]);
    // Request 1 keeps the path 20, 22 (its accepted KV is moved to slots 4 and 5 by the
    // worker) and a bonus token; request 2 keeps nothing.
    s.update(&[20, 22, 40, 50], &[3, 1]).unwrap();
    let r = s.request(1).unwrap();
    assert_eq!((r.num_tokens(), r.num_computed_tokens, r.spec_parents.len()), (7, 6, 0));
    let out = s.schedule().unwrap();
    assert!(out.tree_parents.is_empty(), "no tree this step");
    assert_eq!(out.positions, vec![6, 3]);
}

#[test]
fn a_tree_past_the_token_limit_keeps_its_first_drafts_and_a_bad_tree_is_refused() {
    let mut s = decoding(&[(1, vec![5, 6, 7], 3)], &[10]);
    let err = s.set_spec_tree(1, &[20, 21], &[0, 2]).unwrap_err();
    assert!(err.to_string().contains("spec_parents"), "{err}");
    assert!(s.set_spec_tree(1, &[20, 21], &[0]).is_err());
    assert!(s.set_spec_tree(1, &[20; 64], &[0; 64]).unwrap_err().to_string().contains("at most 63"));
    // Two more tokens may come: a tree of three drafts keeps two.
    s.set_spec_tree(1, &[20, 21, 22], &[0, 0, 1]).unwrap();
    assert_eq!(s.request(1).unwrap().spec_parents, vec![0, 0]);
    let out = s.schedule().unwrap();
    assert_eq!(out.positions, vec![3, 4, 4]);
}

#[test]
fn a_tree_after_requests_without_one_gives_them_chains_in_tree_parents() {
    let mut s = decoding(&[(1, vec![5, 6, 7], 16), (2, vec![8, 9], 16), (3, vec![4], 16)], &[10, 11, 12]);
    s.set_spec_tokens(2, &[30, 31]).unwrap(); // request 1 decodes plainly, 2 verifies a chain
    s.set_spec_tree(3, &[40, 41, 42], &[0, 0, 2]).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.input_ids, vec![10, 11, 30, 31, 12, 40, 41, 42]);
    assert_eq!(out.tree_parents, vec![-1, -1, 0, 1, -1, 0, 0, 2]);
    assert_eq!(out.positions, vec![3, 2, 3, 4, 1, 2, 2, 3]);
}
