//! Test inputs and a thread pool shared by the kernels' tests.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread::ThreadId;

use pyserve_cpu_kernels::ForkJoin;

/// A small deterministic generator (xorshift), values in [-1, 1).
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// Parts taken from a shared counter by `threads` scoped threads; records each call's part count
/// and which threads ran parts.
pub struct ScopedThreads {
    threads: usize,
    pub calls: Mutex<Vec<usize>>,
    pub workers: Mutex<HashSet<ThreadId>>,
}

impl ScopedThreads {
    pub fn new(threads: usize) -> Self {
        ScopedThreads { threads, calls: Mutex::default(), workers: Mutex::default() }
    }
}

impl ForkJoin for ScopedThreads {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
        self.calls.lock().unwrap().push(parts);
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..self.threads {
                s.spawn(|| loop {
                    let part = next.fetch_add(1, Ordering::Relaxed);
                    if part >= parts {
                        return;
                    }
                    self.workers.lock().unwrap().insert(std::thread::current().id());
                    task(part);
                    std::thread::sleep(std::time::Duration::from_millis(1)); // let the other thread take parts
                });
            }
        });
    }

    fn threads(&self) -> usize {
        self.threads
    }
}
