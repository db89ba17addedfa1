//! KV cache manager: the block pool plus the radix prefix cache, seen through requests.
//!
//! A block is in exactly one state: free (on the pool's stack), cached with no reference
//! (evictable), or referenced (count > 0, cached or not). Allocation takes the free stack first and
//! evicts the least recently used cached block only when the stack is empty.

use crate::block_pool::{BlockId, BlockPool, NULL_BLOCK};
use crate::error::Result;
use crate::radix::{PrefixMatch, RadixCache};
use crate::request::Request;

struct AllocationPlan {
    new_blocks: usize,
    cow: Option<usize>,
    cost: usize,
}

#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    radix: RadixCache,
    block_size: usize,
    enable_caching: bool,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool) -> Result<Self> {
        Ok(Self {
            pool: BlockPool::new(num_blocks)?,
            radix: RadixCache::new(num_blocks, block_size),
            block_size,
            enable_caching,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that can hold KV (the null block excluded).
    pub fn num_usable_blocks(&self) -> usize {
        self.pool.num_blocks() - 1
    }

    /// Blocks an allocation may take now: free ones plus unreferenced cached ones.
    pub fn num_allocatable(&self) -> usize {
        self.pool.num_free() + self.radix.num_unreferenced()
    }

    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }

    pub fn num_cached(&self) -> usize {
        self.radix.num_cached()
    }

    /// Fraction of usable blocks that some request references (cached-only blocks do not count).
    pub fn usage(&self) -> f64 {
        let usable = self.num_usable_blocks();
        (usable - self.num_allocatable()) as f64 / usable as f64
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.pool.ref_count(block)
    }

    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The cached prefix of the request's tokens, leaving at least one token to compute (its
    /// logits are needed).
    pub fn match_prefix(&self, req: &Request) -> PrefixMatch {
        if !self.enable_caching || req.num_tokens() == 0 {
            return PrefixMatch::NONE;
        }
        self.radix.match_prefix(&req.namespace, &req.token_ids, req.num_tokens() - 1)
    }

    /// Whether [`Self::allocate_slots`] with the same arguments would succeed.
    pub fn can_allocate(&self, req: &Request, hit: &PrefixMatch, num_slots: usize) -> bool {
        self.plan_allocation(req, hit, num_slots).cost <= self.num_allocatable()
    }

    /// Makes the request hold `hit`'s blocks (appended to its empty table) and enough blocks for
    /// `num_slots` token slots in all. A shared block about to be written is copied first
    /// (copy-on-write: a fork's partly filled block, or a hit's last block matched only in its
    /// first tokens); the `[src, dst]` pair goes to `copies`. Returns false, changing nothing,
    /// when the pool cannot supply the blocks: the caller preempts.
    #[inline]
    pub fn allocate_slots(
        &mut self,
        req: &mut Request,
        hit: &PrefixMatch,
        num_slots: usize,
        copies: &mut Vec<[BlockId; 2]>,
    ) -> bool {
        // The common decode step: the next slots are in blocks the request owns alone.
        if hit.blocks.is_empty() && !req.forked && self.blocks_for(num_slots) <= req.block_table.len() {
            return true;
        }
        self.allocate_slots_slow(req, hit, num_slots, copies)
    }

    fn allocate_slots_slow(
        &mut self,
        req: &mut Request,
        hit: &PrefixMatch,
        num_slots: usize,
        copies: &mut Vec<[BlockId; 2]>,
    ) -> bool {
        debug_assert!(hit.blocks.is_empty() || req.block_table.is_empty());
        let plan = self.plan_allocation(req, hit, num_slots);
        if plan.cost > self.num_allocatable() {
            return false;
        }
        for &block in &hit.blocks {
            self.take_ref(block);
            req.block_table.push(block);
        }
        if let Some(idx) = plan.cow {
            let old = req.block_table[idx];
            let new = self.alloc_block();
            copies.push([old, new]);
            self.release(old);
            req.block_table[idx] = new;
        }
        for _ in 0..plan.new_blocks {
            let block = self.alloc_block();
            req.block_table.push(block);
        }
        true
    }

    /// Drops every block of the request; cached ones stay in the tree as evictable. With caching
    /// on, its computed tokens are cached first: its full blocks, and the computed start of its
    /// last block where it holds that block alone (so a next turn that resends them finds them).
    pub fn free(&mut self, req: &mut Request) {
        if self.enable_caching {
            self.cache_full_blocks(req);
            self.cache_tail_block(req);
        }
        // Tail first, so a prefix outlives its extensions in LRU order.
        for &block in req.block_table.iter().rev() {
            self.release(block);
        }
        req.block_table.clear();
        req.num_inserted_blocks = 0;
        req.cache_node = None;
        req.forked = false;
    }

    /// Inserts the request's full, computed blocks into the prefix cache, resuming from the
    /// last block it inserted. Where an identical block is already cached the request switches
    /// to it and its own copy is released.
    #[inline]
    pub fn cache_full_blocks(&mut self, req: &mut Request) {
        let computed = req.num_computed_tokens.min(req.num_tokens());
        let full = (computed / self.block_size).min(req.block_table.len());
        if self.enable_caching && full > req.num_inserted_blocks {
            self.insert_blocks(req, full);
        }
    }

    fn insert_blocks(&mut self, req: &mut Request, full: usize) {
        let mut node = match req.cache_node {
            Some(node) => node,
            None => self.radix.root(&req.namespace),
        };
        for idx in req.num_inserted_blocks..full {
            let key = &req.token_ids[idx * self.block_size..(idx + 1) * self.block_size];
            let own = req.block_table[idx];
            let (child, block) = self.radix.insert_child(node, key, own);
            if block != own {
                self.take_ref(block);
                self.release(own);
                req.block_table[idx] = block;
            }
            node = child;
        }
        req.cache_node = Some(node);
        req.num_inserted_blocks = full;
    }

    fn cache_tail_block(&mut self, req: &Request) {
        let computed = req.num_computed_tokens.min(req.num_tokens());
        let full = computed / self.block_size;
        if computed % self.block_size == 0 || full >= req.block_table.len() || req.num_inserted_blocks != full {
            return;
        }
        let block = req.block_table[full];
        if self.pool.ref_count(block) != 1 || self.radix.is_cached(block) {
            return; // shared with a fork, or cached already: not this request's to cache
        }
        let parent = match req.cache_node {
            Some(node) => node,
            None => self.radix.root(&req.namespace),
        };
        self.radix.insert_tail(parent, &req.token_ids[full * self.block_size..computed], block);
    }

    /// References the blocks that hold the parent's computed KV, for a forked child.
    pub fn fork(&mut self, parent: &Request) -> Vec<BlockId> {
        let n = self.blocks_for(parent.num_computed_tokens).min(parent.block_table.len());
        let shared = parent.block_table[..n].to_vec();
        for &block in &shared {
            self.take_ref(block);
        }
        shared
    }

    /// Checks that reference counts equal the block-table entries of `tables`, and that every
    /// block is free, cached or referenced exactly as the counters say.
    pub fn check<'a>(&self, tables: impl Iterator<Item = &'a [BlockId]>) -> std::result::Result<(), String> {
        let n = self.pool.num_blocks();
        let mut expected = vec![0u32; n];
        for table in tables {
            for &block in table {
                if block == NULL_BLOCK {
                    return Err("a block table holds the null block".into());
                }
                expected[block as usize] += 1;
            }
        }
        let mut on_free = vec![false; n];
        for &block in self.pool.free_blocks() {
            if block == NULL_BLOCK || on_free[block as usize] {
                return Err(format!("free stack holds block {block} twice or the null block"));
            }
            on_free[block as usize] = true;
        }
        for block in 1..n as BlockId {
            let (count, want) = (self.pool.ref_count(block), expected[block as usize]);
            if count != want {
                return Err(format!("block {block}: refcount {count}, tables hold {want}"));
            }
            let cached = self.radix.is_cached(block);
            let free = on_free[block as usize];
            if count == 0 && cached == free {
                return Err(format!("unreferenced block {block}: cached={cached} free={free}"));
            }
            if count > 0 && free {
                return Err(format!("referenced block {block} is on the free stack"));
            }
        }
        self.radix.check()
    }

    /// What an allocation needs: fresh blocks, the block to copy on write, and the total it takes
    /// from the allocatable supply (cached hits with no reference count too).
    fn plan_allocation(&self, req: &Request, hit: &PrefixMatch, num_slots: usize) -> AllocationPlan {
        let held = req.block_table.len() + hit.blocks.len();
        let new_blocks = self.blocks_for(num_slots).saturating_sub(held);
        let revived = hit.blocks.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        let cow = if hit.num_tokens % self.block_size != 0 { Some(held - 1) } else { self.shared_write_block(req) };
        AllocationPlan { new_blocks, cow, cost: new_blocks + revived + usize::from(cow.is_some()) }
    }

    /// Index of the partly filled block the next token will be written to, if other requests
    /// share it. Only a fork shares a partly filled block (a request's cached blocks are full).
    fn shared_write_block(&self, req: &Request) -> Option<usize> {
        if !req.forked {
            return None;
        }
        let idx = req.num_computed_tokens / self.block_size;
        let partial = req.num_computed_tokens % self.block_size != 0;
        (partial && idx < req.block_table.len() && self.pool.ref_count(req.block_table[idx]) > 1)
            .then_some(idx)
    }

    fn alloc_block(&mut self) -> BlockId {
        if let Some(block) = self.pool.pop_free() {
            return block;
        }
        let block = self.radix.evict_lru().expect("the allocation plan was checked");
        self.pool.incref(block);
        block
    }

    fn take_ref(&mut self, block: BlockId) {
        if self.pool.incref(block) == 1 {
            self.radix.mark_referenced(block);
        }
    }

    fn release(&mut self, block: BlockId) {
        if self.pool.decref(block) == 0 && !self.radix.mark_unreferenced(block) {
            self.pool.push_free(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::NewRequest;

    fn request(id: u64, tokens: usize) -> Request {
        Request::from_new(NewRequest::new(id, (0..tokens as u32).collect()), 8, 0)
    }

    #[test]
    fn allocation_failure_changes_nothing_and_free_returns_every_block() {
        let mut kv = KvCacheManager::new(5, 4, false).unwrap(); // 4 usable blocks
        let mut copies = Vec::new();
        let mut a = request(1, 12);
        assert!(kv.allocate_slots(&mut a, &PrefixMatch::NONE, 12, &mut copies));
        assert_eq!((a.block_table.len(), kv.num_free()), (3, 1));
        let mut b = request(2, 8);
        assert!(!kv.allocate_slots(&mut b, &PrefixMatch::NONE, 8, &mut copies), "two blocks wanted, one free");
        assert_eq!((b.block_table.len(), kv.num_free()), (0, 1));
        kv.free(&mut a);
        assert_eq!((a.block_table.len(), kv.num_free(), kv.usage()), (0, 4, 0.0));
        assert!(copies.is_empty());
    }

    #[test]
    fn a_fork_shares_blocks_and_its_first_write_copies_the_partial_one() {
        let mut kv = KvCacheManager::new(9, 4, false).unwrap();
        let mut copies = Vec::new();
        let mut parent = request(1, 6);
        assert!(kv.allocate_slots(&mut parent, &PrefixMatch::NONE, 6, &mut copies));
        parent.num_computed_tokens = 6;
        let mut child = parent.clone();
        child.block_table = kv.fork(&parent);
        parent.forked = true;
        child.forked = true;
        assert_eq!(child.block_table, parent.block_table);
        assert_eq!(kv.ref_count(parent.block_table[1]), 2);
        // The child writes position 6, in the shared half-full block 1: it gets a copy.
        assert!(kv.allocate_slots(&mut child, &PrefixMatch::NONE, 7, &mut copies));
        assert_eq!(copies, vec![[parent.block_table[1], child.block_table[1]]]);
        assert_eq!(child.block_table[0], parent.block_table[0], "the full block stays shared");
        assert_eq!((kv.ref_count(parent.block_table[0]), kv.ref_count(parent.block_table[1])), (2, 1));
        kv.free(&mut child);
        kv.free(&mut parent);
        assert_eq!(kv.num_free(), 8);
    }
}
