//! Token-exact radix tree over KV blocks.
//!
//! Each edge is one block of tokens (a page-granular radix tree: the KV cache is only shared and
//! evicted in whole blocks, so edges are never split): a full block, or, for a leaf, the first
//! tokens of a finished sequence's last block (a tail). Children are looked up by the token slice,
//! compared for equality: a hash only picks the bucket, never decides identity. A lookup may end
//! inside a block, where a child's first tokens match what follows the chain: the caller copies
//! that block rather than sharing it.
//! Each [`Namespace`] (LoRA adapter, cache salt) has its own root, so two adapters or tenants never
//! share a block.
//!
//! The tree holds block ids, not references: the cache manager tells it when a cached block loses
//! its last reference ([`RadixCache::mark_unreferenced`]) or gains one
//! ([`RadixCache::mark_referenced`]). Unreferenced leaves are evictable, oldest first.
//!
//! NOTE: eviction only ever takes leaves. That is complete because a request that references a
//! cached block references every ancestor of it too (its block table is a path from the root), so
//! unreferenced nodes form subtrees that can be peeled from the leaves up.

use std::collections::{BTreeSet, HashMap};

use rustc_hash::FxHashMap;

use crate::block_pool::BlockId;

/// Who may share a cached prefix: the same adapter and the same cache salt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Namespace {
    /// LoRA adapter id; 0 is the base model.
    pub adapter_id: u32,
    /// Tenant salt; requests with different salts never share KV.
    pub salt: String,
}

impl Namespace {
    pub fn new(adapter_id: u32, salt: impl Into<String>) -> Self {
        Self { adapter_id, salt: salt.into() }
    }
}

/// A cached prefix: its blocks, and the tokens they hold for it. Where `num_tokens` is not a
/// multiple of the block size the last block matched only its first tokens.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    pub blocks: Vec<BlockId>,
    pub num_tokens: usize,
}

impl PrefixMatch {
    /// No cached prefix.
    pub const NONE: PrefixMatch = PrefixMatch { blocks: Vec::new(), num_tokens: 0 };

    /// The match without a last block matched only in its first tokens (blocks of `block_size`).
    pub fn whole_blocks(&self, block_size: usize) -> PrefixMatch {
        let n = self.num_tokens / block_size;
        PrefixMatch { blocks: self.blocks[..n].to_vec(), num_tokens: n * block_size }
    }
}

/// Handle of a tree node. Valid while the node's block is referenced (such a node is never
/// evicted); roots stay valid while their namespace has cached blocks.
pub type NodeId = u32;
const NO_NODE: NodeId = u32::MAX;

#[derive(Debug)]
struct Node {
    parent: NodeId,
    block: BlockId,
    key: Box<[u32]>,
    children: FxHashMap<Box<[u32]>, NodeId>,
    referenced: bool,
    last_access: u64,
    /// Set on roots only, to drop them when their tree empties.
    namespace: Option<Namespace>,
}

#[derive(Debug)]
pub struct RadixCache {
    block_size: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    roots: HashMap<Namespace, NodeId>,
    node_of_block: Vec<NodeId>,
    evictable: BTreeSet<(u64, NodeId)>,
    clock: u64,
    num_cached: usize,
    num_unreferenced: usize,
}

impl RadixCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::new(),
            node_of_block: vec![NO_NODE; num_blocks],
            evictable: BTreeSet::new(),
            clock: 0,
            num_cached: 0,
            num_unreferenced: 0,
        }
    }

    /// Blocks held by the tree.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Cached blocks that no request references: all can be reclaimed by eviction.
    pub fn num_unreferenced(&self) -> usize {
        self.num_unreferenced
    }

    pub fn is_cached(&self, block: BlockId) -> bool {
        self.node_of_block[block as usize] != NO_NODE
    }

    /// Longest cached prefix of `tokens`, at most `max_tokens` long: the chain of full blocks
    /// that prefixes them, then the block whose first tokens match the most of what follows
    /// (ties: any), where one matches at least one token.
    pub fn match_prefix(&self, ns: &Namespace, tokens: &[u32], max_tokens: usize) -> PrefixMatch {
        let mut out = PrefixMatch::default();
        let Some(&root) = self.roots.get(ns) else { return out };
        let tokens = &tokens[..max_tokens.min(tokens.len())];
        let mut node = root;
        for key in tokens.chunks_exact(self.block_size) {
            match self.nodes[node as usize].children.get(key) {
                Some(&child) => {
                    out.blocks.push(self.nodes[child as usize].block);
                    node = child;
                }
                None => break,
            }
        }
        out.num_tokens = out.blocks.len() * self.block_size;
        let rest = &tokens[out.num_tokens..];
        let partial = self.nodes[node as usize]
            .children
            .iter()
            .map(|(key, &child)| (key.iter().zip(rest).take_while(|(a, b)| a == b).count(), child))
            .max_by_key(|&(shared, _)| shared);
        if let Some((shared, child)) = partial.filter(|&(shared, _)| shared > 0) {
            out.blocks.push(self.nodes[child as usize].block);
            out.num_tokens += shared;
        }
        out
    }

    /// Inserts the chain of full blocks `blocks` for `tokens` (`blocks[i]` holds
    /// `tokens[i*bs..(i+1)*bs]`), walking from the namespace's root; keys already on the tree
    /// keep their block. Every given block must be referenced by the caller, and so must be the
    /// blocks the tree already holds for the chain (a referenced node never hangs under an
    /// unreferenced one).
    ///
    /// Returns, for each index from `start`, the block the tree holds for that key: the given one
    /// when it was inserted, or an earlier identical block the caller should switch to.
    pub fn insert(
        &mut self,
        ns: &Namespace,
        tokens: &[u32],
        blocks: &[BlockId],
        start: usize,
    ) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(blocks.len().saturating_sub(start));
        if blocks.is_empty() {
            return out;
        }
        let mut node = self.root(ns);
        for (i, key) in tokens.chunks_exact(self.block_size).take(blocks.len()).enumerate() {
            let (child, block) = self.insert_child(node, key, blocks[i]);
            if i >= start {
                out.push(block);
            }
            node = child;
        }
        out
    }

    /// The root of a namespace's tree, created on first use.
    pub fn root(&mut self, ns: &Namespace) -> NodeId {
        if let Some(&root) = self.roots.get(ns) {
            return root;
        }
        let root = self.new_node(Node {
            parent: NO_NODE,
            block: 0,
            key: Box::new([]),
            children: FxHashMap::default(),
            referenced: true,
            last_access: 0,
            namespace: Some(ns.clone()),
        });
        self.roots.insert(ns.clone(), root);
        root
    }

    /// The child of `parent` for one block of tokens `key`: the existing one, or a new node
    /// holding `block` (which must be referenced and not cached). Returns the child and the
    /// block it holds.
    pub fn insert_child(&mut self, parent: NodeId, key: &[u32], block: BlockId) -> (NodeId, BlockId) {
        debug_assert_eq!(key.len(), self.block_size);
        if let Some(&child) = self.nodes[parent as usize].children.get(key) {
            return (child, self.nodes[child as usize].block);
        }
        (self.add_child(parent, key, block), block)
    }

    /// Caches `block` as a tail under `parent`: it holds `key`, fewer tokens than a block, the
    /// start of the block after `parent`'s (a lookup's partial match may copy it). Nothing is
    /// cached where a child of `parent` already starts with those tokens. Returns whether `block`
    /// is now cached; it must be referenced and not cached.
    pub fn insert_tail(&mut self, parent: NodeId, key: &[u32], block: BlockId) -> bool {
        debug_assert!(!key.is_empty() && key.len() < self.block_size);
        if self.nodes[parent as usize].children.keys().any(|k| k.starts_with(key)) {
            return false;
        }
        self.add_child(parent, key, block);
        true
    }

    /// A cached block gained its first reference: it is no longer evictable.
    pub fn mark_referenced(&mut self, block: BlockId) {
        let node = self.node_of_block[block as usize];
        if node == NO_NODE {
            return;
        }
        let n = &mut self.nodes[node as usize];
        if !n.referenced {
            n.referenced = true;
            self.num_unreferenced -= 1;
            self.evictable.remove(&(n.last_access, node));
        }
    }

    /// A cached block lost its last reference: it stays cached and becomes evictable (once a
    /// leaf). Returns false when the block is not cached (the caller frees it).
    pub fn mark_unreferenced(&mut self, block: BlockId) -> bool {
        let node = self.node_of_block[block as usize];
        if node == NO_NODE {
            return false;
        }
        self.clock += 1;
        let n = &mut self.nodes[node as usize];
        debug_assert!(n.referenced);
        n.referenced = false;
        n.last_access = self.clock;
        self.num_unreferenced += 1;
        if n.children.is_empty() {
            self.evictable.insert((n.last_access, node));
        }
        true
    }

    /// Evicts the least recently used unreferenced leaf; returns its block, now owned by nobody.
    pub fn evict_lru(&mut self) -> Option<BlockId> {
        let (_, node) = self.evictable.pop_first()?;
        let (parent, block, key) = {
            let n = &mut self.nodes[node as usize];
            (n.parent, n.block, std::mem::take(&mut n.key))
        };
        self.nodes[parent as usize].children.remove(&key);
        self.node_of_block[block as usize] = NO_NODE;
        self.free_nodes.push(node);
        self.num_cached -= 1;
        self.num_unreferenced -= 1;
        let p = &self.nodes[parent as usize];
        if p.children.is_empty() {
            if let Some(ns) = &p.namespace {
                let ns = ns.clone();
                self.roots.remove(&ns);
                self.free_nodes.push(parent);
            } else if !p.referenced {
                self.evictable.insert((p.last_access, parent));
            }
        }
        Some(block)
    }

    /// Checks the tree's own bookkeeping; used by tests.
    pub fn check(&self) -> Result<(), String> {
        let mut cached = 0;
        let mut unref = 0;
        let mut leaves = BTreeSet::new();
        for (&block_node, block) in self.node_of_block.iter().zip(0u32..) {
            if block_node == NO_NODE {
                continue;
            }
            let n = &self.nodes[block_node as usize];
            if n.block != block {
                return Err(format!("node of block {block} holds block {}", n.block));
            }
            cached += 1;
            if !n.referenced {
                unref += 1;
                if n.children.is_empty() {
                    leaves.insert((n.last_access, block_node));
                }
            } else if n.parent != NO_NODE
                && !self.nodes[n.parent as usize].referenced
                && self.nodes[n.parent as usize].namespace.is_none()
            {
                return Err(format!("referenced block {block} under an unreferenced parent"));
            }
        }
        if cached != self.num_cached || unref != self.num_unreferenced {
            return Err(format!(
                "counters: cached {cached}/{} unreferenced {unref}/{}",
                self.num_cached, self.num_unreferenced
            ));
        }
        if leaves != self.evictable {
            return Err("evictable set differs from unreferenced leaves".into());
        }
        Ok(())
    }

    fn add_child(&mut self, parent: NodeId, key: &[u32], block: BlockId) -> NodeId {
        debug_assert_eq!(self.node_of_block[block as usize], NO_NODE);
        let p = &self.nodes[parent as usize];
        if p.children.is_empty() && !p.referenced {
            self.evictable.remove(&(p.last_access, parent));
        }
        let node = self.new_node(Node {
            parent,
            block,
            key: key.into(),
            children: FxHashMap::default(),
            referenced: true,
            last_access: 0,
            namespace: None,
        });
        self.nodes[parent as usize].children.insert(key.into(), node);
        self.node_of_block[block as usize] = node;
        self.num_cached += 1;
        node
    }

    fn new_node(&mut self, node: Node) -> NodeId {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(a: u32) -> Namespace {
        Namespace::new(a, "")
    }

    fn hit(blocks: &[BlockId], num_tokens: usize) -> PrefixMatch {
        PrefixMatch { blocks: blocks.to_vec(), num_tokens }
    }

    #[test]
    fn match_is_token_exact_and_ends_inside_a_block() {
        let mut t = RadixCache::new(16, 2);
        let toks = [1, 2, 3, 4, 5];
        assert_eq!(t.insert(&ns(0), &toks, &[7, 8], 0), vec![7, 8]);
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 4, 9], 10), hit(&[7, 8], 4));
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 9], 10), hit(&[7, 8], 3), "block 8's first token");
        assert_eq!(t.match_prefix(&ns(0), &[1, 3], 10), hit(&[7], 1));
        assert_eq!(t.match_prefix(&ns(0), &[2, 3], 10), PrefixMatch::NONE);
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 4], 3), hit(&[7, 8], 3), "at most max_tokens");
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 4], 2), hit(&[7], 2));
        t.insert(&ns(0), &[1, 2, 3, 6, 5, 5], &[7, 9, 10], 0);
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 6, 5, 1], 10), hit(&[7, 9, 10], 5), "inside the block after the chain");
    }

    #[test]
    fn a_tail_is_matched_in_part_and_never_twice() {
        let mut t = RadixCache::new(16, 4);
        t.insert(&ns(0), &[1, 2, 3, 4], &[7], 0);
        let node = t.node_of_block[7];
        assert!(t.insert_tail(node, &[5, 6], 8));
        assert!(!t.insert_tail(node, &[5], 9), "a child already starts with it");
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 4, 5, 6, 9], 10), hit(&[7, 8], 6));
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 4, 5, 9], 10), hit(&[7, 8], 5));
        assert_eq!(t.match_prefix(&ns(0), &[1, 2, 3, 4, 5, 6], 5), hit(&[7, 8], 5), "at most max_tokens");
        assert!(t.mark_unreferenced(8) && t.mark_unreferenced(7));
        t.check().unwrap();
        assert_eq!((t.evict_lru(), t.evict_lru(), t.evict_lru()), (Some(8), Some(7), None), "the tail is a leaf");
    }

    #[test]
    fn empty_insert_creates_no_root() {
        let mut t = RadixCache::new(16, 2);
        assert!(t.insert(&ns(0), &[1], &[], 0).is_empty());
        assert!(t.roots.is_empty());
    }

    #[test]
    fn namespaces_never_share() {
        let mut t = RadixCache::new(16, 2);
        t.insert(&ns(0), &[1, 2], &[3], 0);
        assert_eq!(t.match_prefix(&ns(1), &[1, 2], 10), PrefixMatch::NONE);
        assert_eq!(t.match_prefix(&Namespace::new(0, "tenant"), &[1, 2], 10), PrefixMatch::NONE);
        assert_eq!(t.insert(&ns(1), &[1, 2], &[4], 0), vec![4]);
        assert_eq!(t.match_prefix(&ns(1), &[1, 2], 10), hit(&[4], 2));
    }

    #[test]
    fn duplicate_insert_returns_existing_block() {
        let mut t = RadixCache::new(16, 2);
        t.insert(&ns(0), &[1, 2, 3, 4], &[5, 6], 0);
        assert_eq!(t.insert(&ns(0), &[1, 2, 3, 4, 7, 8], &[9, 10, 11], 0), vec![5, 6, 11]);
        assert!(!t.is_cached(9));
        assert!(t.is_cached(11));
    }

    #[test]
    fn evicts_leaves_lru_then_parents() {
        let mut t = RadixCache::new(16, 1);
        t.insert(&ns(0), &[1, 2], &[3, 4], 0);
        t.insert(&ns(0), &[5], &[6], 0);
        assert_eq!(t.evict_lru(), None, "referenced blocks are not evictable");
        t.mark_unreferenced(6);
        t.mark_unreferenced(4);
        t.mark_unreferenced(3);
        t.check().unwrap();
        assert_eq!(t.num_unreferenced(), 3);
        assert_eq!(t.evict_lru(), Some(6));
        assert_eq!(t.evict_lru(), Some(4));
        assert_eq!(t.evict_lru(), Some(3));
        assert_eq!(t.evict_lru(), None);
        assert_eq!(t.num_cached(), 0);
        t.check().unwrap();
    }

    #[test]
    fn rereferenced_block_is_not_evicted() {
        let mut t = RadixCache::new(16, 1);
        t.insert(&ns(0), &[1, 2], &[3, 4], 0);
        t.mark_unreferenced(4);
        t.mark_unreferenced(3);
        t.mark_referenced(3);
        t.mark_referenced(4);
        assert_eq!(t.evict_lru(), None);
        t.check().unwrap();
    }
}
