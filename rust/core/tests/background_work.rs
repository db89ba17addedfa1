//! The scheduling policy for background work (priority >= BACKGROUND_PRIORITY: batch jobs),
//! pinned case by case: it yields to foreground requests' prompts, blocks and seats, and runs as
//! many at a time as each step allows.

mod common;

use common::{config, no_drafts, req, Driver};
use pyserve_core::{Scheduler, BACKGROUND_PRIORITY};

#[test]
fn background_requests_pause_while_a_foreground_prompt_is_computed() {
    let mut d = Driver::new(Scheduler::new(config(64, 4, 64)).unwrap());
    for id in [1, 2] {
        let mut r = req(id, vec![id as u32; 4], 20);
        r.priority = BACKGROUND_PRIORITY;
        d.add(r).unwrap();
    }
    d.step(no_drafts);
    assert_eq!(d.step(no_drafts).req_ids, vec![1, 2], "background decodes run when nothing else does");
    d.add(req(3, vec![7; 6], 3)).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.req_ids, vec![3], "the foreground prompt runs alone");
    let out = d.step(no_drafts);
    assert_eq!(out.req_ids, vec![3, 1, 2], "decoding, the foreground request shares steps again, first");
    d.run_to_end(100, no_drafts);
    assert_eq!(d.finished.len(), 3);
}

#[test]
fn a_step_schedules_at_most_the_background_requests_it_is_allowed() {
    let mut d = Driver::new(Scheduler::new(config(128, 4, 64)).unwrap());
    for id in 1..=5 {
        let mut r = req(id, vec![id as u32; 4], 20);
        r.priority = BACKGROUND_PRIORITY;
        d.add(r).unwrap();
    }
    d.step(no_drafts);
    assert!(!d.sched.has_foreground_requests());
    assert_eq!(d.step(no_drafts).req_ids, vec![1, 2, 3, 4, 5], "no limit: every background request decodes");
    d.max_background = Some(2);
    d.add(req(9, vec![7; 6], 3)).unwrap();
    assert!(d.sched.has_foreground_requests());
    assert_eq!(d.step(no_drafts).req_ids, vec![9], "the foreground prompt runs alone");
    assert_eq!(d.step(no_drafts).req_ids, vec![9, 1, 2], "two background requests beside its decode");
    while !d.finished.contains_key(&9) {
        d.step(no_drafts);
    }
    assert!(!d.sched.has_foreground_requests());
    assert_eq!(d.step(no_drafts).req_ids, vec![1, 2], "the limit holds without foreground work too");
    d.max_background = None;
    d.run_to_end(200, no_drafts);
    assert_eq!(d.finished.len(), 6, "the others waited, and finished after");
}

#[test]
fn a_foreground_request_takes_a_background_seat_when_all_are_taken() {
    let mut c = config(128, 4, 64);
    c.max_num_seqs = 3;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    for id in 1..=3 {
        let mut r = req(id, vec![id as u32; 4], 20);
        r.priority = BACKGROUND_PRIORITY;
        d.add(r).unwrap();
    }
    d.step(no_drafts);
    d.add(req(9, vec![7; 6], 3)).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.preempted_req_ids, vec![3], "the newest background request gave up its seat");
    assert_eq!(out.req_ids, vec![9], "the foreground prompt runs at once");
    d.add(req(10, vec![8; 6], 3)).unwrap();
    let mut r = req(11, vec![6; 4], 3);
    r.priority = BACKGROUND_PRIORITY;
    d.add(r).unwrap();
    let out = d.step(no_drafts);
    assert_eq!(out.preempted_req_ids, vec![2], "a second foreground request takes the next seat");
    assert_eq!(out.req_ids, vec![9, 10]);
    assert_eq!(d.sched.num_running(), 3, "request 1 keeps its seat; 2, 3 and 11 wait");
    d.run_to_end(300, no_drafts);
    assert_eq!(d.finished.len(), 6);
}

#[test]
fn a_foreground_request_preempts_background_work_for_blocks() {
    // 12 usable blocks of 2 tokens; two background requests grow to 6 blocks each.
    let mut c = config(13, 2, 64);
    c.enable_prefix_caching = false;
    let mut d = Driver::new(Scheduler::new(c).unwrap());
    for id in [1, 2] {
        let mut r = req(id, vec![id as u32; 4], 8);
        r.priority = BACKGROUND_PRIORITY;
        d.add(r).unwrap();
    }
    for _ in 0..5 {
        d.step(no_drafts); // 9 tokens each: 5 blocks each, 2 left
    }
    d.add(req(3, vec![9; 8], 2)).unwrap(); // needs 4 blocks, then a fifth to decode
    let mut preempted = Vec::new();
    for _ in 0..4 {
        preempted.extend(d.step(no_drafts).preempted_req_ids);
        if d.finished.contains_key(&3) {
            break;
        }
    }
    assert!(d.finished.contains_key(&3), "the foreground request finished first");
    assert!(!preempted.is_empty() && preempted.iter().all(|&id| id != 3));
    d.run_to_end(200, no_drafts);
    assert_eq!(d.finished.len(), 3, "the background work finished after it");
}

#[test]
fn under_a_limit_background_prompts_take_at_most_a_block_a_step() {
    let mut d = Driver::new(Scheduler::new(config(128, 4, 64)).unwrap());
    let mut r = req(1, vec![1; 30], 4);
    r.priority = BACKGROUND_PRIORITY;
    d.add(r).unwrap();
    d.max_background = Some(2);
    let mut chunks = Vec::new();
    while chunks.iter().sum::<usize>() < 30 {
        chunks.push(d.step(no_drafts).num_scheduled_tokens[0] as usize);
    }
    assert_eq!(chunks, vec![4, 4, 4, 4, 4, 4, 4, 2], "a block (4 tokens) a step");
    let mut r = req(2, vec![2; 30], 4);
    r.priority = BACKGROUND_PRIORITY;
    d.add(r).unwrap();
    d.max_background = None;
    let out = d.step(no_drafts);
    assert_eq!(out.num_scheduled_tokens, vec![1, 30], "without a limit the prompt takes the whole step");
    d.run_to_end(100, no_drafts);
    assert_eq!(d.finished.len(), 2);
}
