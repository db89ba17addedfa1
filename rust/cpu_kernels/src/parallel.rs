//! How a kernel spreads its work over threads it does not own. The caller passes a `ForkJoin`:
//! in pyserve, torch's own OpenMP team, whose threads spin between torch ops (a second pool of
//! threads would compete with them for the same cores).

/// Below this many multiply-adds a kernel call runs on the calling thread: a fork and join costs
/// more than it saves, even when the other threads are awake.
pub(crate) const MIN_PARALLEL_WORK: usize = 1 << 17;

/// Parts a kernel splits its work into per thread of the pool: threads take parts until none is
/// left, so one that finishes early takes another.
pub(crate) const PARTS_PER_THREAD: usize = 4;

/// Runs `task(0)`, ..., `task(parts - 1)`, each exactly once, possibly on several threads at
/// once, and returns when all have run.
pub trait ForkJoin: Sync {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync));
    /// The most threads `run` uses at once.
    fn threads(&self) -> usize;
}

/// Every part in turn on the calling thread.
pub struct OnCallingThread;

impl ForkJoin for OnCallingThread {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
        (0..parts).for_each(task);
    }

    fn threads(&self) -> usize {
        1
    }
}
