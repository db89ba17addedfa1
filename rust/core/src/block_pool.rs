//! A fixed pool of KV-cache blocks with reference counts.
//!
//! Block 0 is the null block: never handed out, used as padding in block tables. A block with a
//! zero count is either on the free stack or held by the radix cache (cached, evictable); the
//! pool only knows the free stack, the cache manager knows the rest.

use crate::error::{config_err, Result};

/// Index of a block in the pool.
pub type BlockId = u32;

/// The reserved padding block.
pub const NULL_BLOCK: BlockId = 0;

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    /// Blocks with a zero count that no cache holds. A stack: O(1) pop and push.
    free: Vec<BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, all free but block 0.
    pub fn new(num_blocks: usize) -> Result<Self> {
        if num_blocks < 2 || num_blocks > u32::MAX as usize {
            return Err(config_err("num_blocks", format!("must be in 2..2^32, got {num_blocks}")));
        }
        // Reversed so that blocks are handed out in increasing order.
        let free = (1..num_blocks as BlockId).rev().collect();
        Ok(Self { ref_counts: vec![0; num_blocks], free })
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks on the free stack (not counting cached blocks that could be evicted).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Takes a block off the free stack with a count of one; `None` when the stack is empty.
    pub fn pop_free(&mut self) -> Option<BlockId> {
        let block = self.free.pop()?;
        debug_assert_eq!(self.ref_counts[block as usize], 0);
        self.ref_counts[block as usize] = 1;
        Some(block)
    }

    /// Returns a zero-count block that no cache holds to the free stack.
    pub fn push_free(&mut self, block: BlockId) {
        debug_assert!(block != NULL_BLOCK && self.ref_counts[block as usize] == 0);
        self.free.push(block);
    }

    /// Adds one reference; returns the new count.
    pub fn incref(&mut self, block: BlockId) -> u32 {
        debug_assert!(block != NULL_BLOCK);
        let count = &mut self.ref_counts[block as usize];
        *count += 1;
        *count
    }

    /// Drops one reference; returns the new count. The caller decides where a block whose
    /// count reached zero goes (free stack or cache).
    pub fn decref(&mut self, block: BlockId) -> u32 {
        debug_assert!(block != NULL_BLOCK);
        let count = &mut self.ref_counts[block as usize];
        debug_assert!(*count > 0, "decref of unreferenced block {block}");
        *count -= 1;
        *count
    }

    /// The free stack, for invariant checks.
    pub fn free_blocks(&self) -> &[BlockId] {
        &self.free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_block_is_never_allocated() {
        let mut pool = BlockPool::new(4).unwrap();
        let got: Vec<_> = std::iter::from_fn(|| pool.pop_free()).collect();
        assert_eq!(got, vec![1, 2, 3]);
        assert_eq!(pool.num_free(), 0);
    }

    #[test]
    fn refcounts_round_trip() {
        let mut pool = BlockPool::new(3).unwrap();
        let b = pool.pop_free().unwrap();
        assert_eq!(pool.incref(b), 2);
        assert_eq!(pool.decref(b), 1);
        assert_eq!(pool.decref(b), 0);
        pool.push_free(b);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.pop_free(), Some(b));
    }

    #[test]
    fn rejects_tiny_pool() {
        assert!(BlockPool::new(1).is_err());
    }
}
