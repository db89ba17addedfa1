//! A radix tree over the bytes of the text routed to each replica.
//!
//! One tree serves every replica: a node is *marked* by each replica whose routed text passed
//! through it, with the tick of that replica's last visit. Marks are prefix-closed (a replica that
//! marks a node marks all its ancestors), so a replica's matched length is the depth of the
//! deepest marked node on the query's path, and eviction only ever unmarks a replica's leaves
//! (marked nodes none of whose children it marks), oldest first.
//!
//! Each replica's size is the bytes of the edges it marks; eviction brings it under a bound.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

/// Index of a replica, `0..num_replicas`.
pub type ReplicaId = usize;

type NodeId = u32;
const ROOT: NodeId = 0;

#[derive(Debug, Default)]
struct Node {
    parent: NodeId,
    /// The edge's bytes, from the parent to this node.
    edge: Vec<u8>,
    /// Children by the first byte of their edge.
    children: FxHashMap<u8, NodeId>,
    /// (replica, tick of its last visit), one entry per replica that marks this node.
    marks: Vec<(ReplicaId, u64)>,
}

impl Node {
    fn tick_of(&self, replica: ReplicaId) -> Option<u64> {
        self.marks.iter().find(|m| m.0 == replica).map(|m| m.1)
    }
}

#[derive(Debug)]
pub struct PrefixTree {
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    bytes: Vec<usize>,
    clock: u64,
}

impl PrefixTree {
    pub fn new(num_replicas: usize) -> Self {
        Self { nodes: vec![Node::default()], free: Vec::new(), bytes: vec![0; num_replicas], clock: 0 }
    }

    pub fn num_replicas(&self) -> usize {
        self.bytes.len()
    }

    /// Bytes of text the tree holds for `replica`.
    pub fn bytes(&self, replica: ReplicaId) -> usize {
        self.bytes[replica]
    }

    /// Nodes in the tree, the root included (for tests and figures).
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Records that `text` was sent to `replica`: every node on its path is marked with a new tick.
    pub fn insert(&mut self, text: &[u8], replica: ReplicaId) {
        self.clock += 1;
        let tick = self.clock;
        let mut cur = ROOT;
        let mut pos = 0;
        self.mark(cur, replica, tick);
        while pos < text.len() {
            let Some(&child) = self.nodes[cur as usize].children.get(&text[pos]) else {
                let leaf = self.alloc(cur, text[pos..].to_vec());
                self.nodes[cur as usize].children.insert(text[pos], leaf);
                self.mark(leaf, replica, tick);
                return;
            };
            let common = common_prefix(&self.nodes[child as usize].edge, &text[pos..]);
            let next = if common < self.nodes[child as usize].edge.len() {
                self.split(child, common)
            } else {
                child
            };
            pos += common;
            cur = next;
            self.mark(cur, replica, tick);
        }
    }

    /// For each replica, how many leading bytes of `text` its marked path covers.
    pub fn match_lengths(&self, text: &[u8]) -> Vec<usize> {
        let mut out = vec![0; self.num_replicas()];
        let mut cur = ROOT;
        let mut pos = 0;
        while pos < text.len() {
            let Some(&child) = self.nodes[cur as usize].children.get(&text[pos]) else { break };
            let node = &self.nodes[child as usize];
            let common = common_prefix(&node.edge, &text[pos..]);
            for &(replica, _) in &node.marks {
                out[replica] = pos + common;
            }
            if common < node.edge.len() {
                break;
            }
            pos += common;
            cur = child;
        }
        out
    }

    /// Unmarks `replica`'s least recently visited leaves until it holds at most `max_bytes`.
    pub fn evict(&mut self, replica: ReplicaId, max_bytes: usize) {
        if self.bytes[replica] <= max_bytes {
            return;
        }
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = BinaryHeap::new();
        for (id, node) in self.nodes.iter().enumerate().skip(1) {
            if let Some(tick) = node.tick_of(replica) {
                if self.is_leaf_of(id as NodeId, replica) {
                    heap.push(Reverse((tick, id as NodeId)));
                }
            }
        }
        while self.bytes[replica] > max_bytes {
            let Some(Reverse((_, id))) = heap.pop() else { break };
            let parent = self.nodes[id as usize].parent;
            self.unmark(id, replica);
            if parent != ROOT && self.is_leaf_of(parent, replica) {
                if let Some(tick) = self.nodes[parent as usize].tick_of(replica) {
                    heap.push(Reverse((tick, parent)));
                }
            }
        }
    }

    /// Forgets everything routed to `replica` (it died or restarted with an empty cache).
    pub fn remove_replica(&mut self, replica: ReplicaId) {
        for node in &mut self.nodes {
            node.marks.retain(|m| m.0 != replica);
        }
        self.bytes[replica] = 0;
        self.prune_subtree(ROOT);
    }

    /// Frees every node under `id` (and `id`) that no replica marks and that keeps no child.
    fn prune_subtree(&mut self, id: NodeId) {
        // Parents before children in `order`, so the reverse visits children first.
        let mut order = vec![id];
        let mut i = 0;
        while i < order.len() {
            order.extend(self.nodes[order[i] as usize].children.values().copied());
            i += 1;
        }
        for &n in order.iter().rev() {
            self.prune(n);
        }
    }

    fn unmark(&mut self, id: NodeId, replica: ReplicaId) {
        let node = &mut self.nodes[id as usize];
        if let Some(i) = node.marks.iter().position(|m| m.0 == replica) {
            node.marks.swap_remove(i);
            self.bytes[replica] -= node.edge.len();
        }
        self.prune(id);
    }

    /// Frees `id` if no replica marks it and it has no children.
    fn prune(&mut self, id: NodeId) {
        let node = &self.nodes[id as usize];
        if id == ROOT || !node.marks.is_empty() || !node.children.is_empty() {
            return;
        }
        let (parent, first) = (node.parent, node.edge[0]);
        self.nodes[parent as usize].children.remove(&first);
        self.nodes[id as usize] = Node::default();
        self.free.push(id);
    }

    fn is_leaf_of(&self, id: NodeId, replica: ReplicaId) -> bool {
        self.nodes[id as usize].children.values().all(|&c| self.nodes[c as usize].tick_of(replica).is_none())
    }

    fn mark(&mut self, id: NodeId, replica: ReplicaId, tick: u64) {
        let node = &mut self.nodes[id as usize];
        match node.marks.iter_mut().find(|m| m.0 == replica) {
            Some(m) => m.1 = tick,
            None => {
                node.marks.push((replica, tick));
                self.bytes[replica] += node.edge.len();
            }
        }
    }

    /// Splits `child`'s edge after `at` bytes; returns the new upper node, which keeps the marks.
    fn split(&mut self, child: NodeId, at: usize) -> NodeId {
        let parent = self.nodes[child as usize].parent;
        let tail = self.nodes[child as usize].edge.split_off(at);
        let head = std::mem::take(&mut self.nodes[child as usize].edge);
        let first = head[0];
        let marks = self.nodes[child as usize].marks.clone();
        let upper = self.alloc(parent, head);
        self.nodes[upper as usize].marks = marks;
        self.nodes[upper as usize].children.insert(tail[0], child);
        self.nodes[parent as usize].children.insert(first, upper);
        let node = &mut self.nodes[child as usize];
        node.edge = tail;
        node.parent = upper;
        upper
    }

    fn alloc(&mut self, parent: NodeId, edge: Vec<u8>) -> NodeId {
        let node = Node { parent, edge, ..Node::default() };
        match self.free.pop() {
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

    /// Panics if an invariant is broken: marks prefix-closed, sizes equal to the marked edges,
    /// no empty non-root node, children keyed by their first byte. For tests.
    pub fn check_invariants(&self) {
        let mut bytes = vec![0; self.num_replicas()];
        let mut stack = vec![ROOT];
        let mut seen = 1;
        while let Some(id) = stack.pop() {
            let node = &self.nodes[id as usize];
            for &(r, _) in &node.marks {
                bytes[r] += node.edge.len();
            }
            if id != ROOT {
                assert!(!node.edge.is_empty(), "node {id} has an empty edge");
                assert!(!node.marks.is_empty() || !node.children.is_empty(), "node {id} is empty and kept");
            }
            for (&first, &c) in &node.children {
                let child = &self.nodes[c as usize];
                assert_eq!(child.edge[0], first, "child {c} is keyed by the wrong byte");
                assert_eq!(child.parent, id, "child {c} has the wrong parent");
                for &(r, _) in &child.marks {
                    assert!(
                        node.tick_of(r).is_some() || id == ROOT,
                        "replica {r} marks {c} but not its parent"
                    );
                }
                seen += 1;
                stack.push(c);
            }
        }
        assert_eq!(bytes, self.bytes, "per-replica sizes disagree with the marked edges");
        assert_eq!(seen, self.num_nodes(), "unreachable nodes");
    }
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn match_lengths_follow_each_replicas_text() {
        let mut tree = PrefixTree::new(3);
        tree.insert(b"system: be brief. user: hi", 0);
        tree.insert(b"system: be brief. user: bye", 1);
        tree.check_invariants();
        assert_eq!(tree.match_lengths(b"system: be brief. user: hi there"), vec![26, 24, 0]);
        assert_eq!(tree.match_lengths(b"sys"), vec![3, 3, 0]);
        assert_eq!(tree.match_lengths(b"other"), vec![0, 0, 0]);
        assert_eq!(tree.bytes(0), 26);
        assert_eq!(tree.bytes(1), 27);
    }

    #[test]
    fn eviction_drops_the_oldest_leaves_first() {
        let mut tree = PrefixTree::new(1);
        tree.insert(b"aaaa-old", 0);
        tree.insert(b"aaaa-new", 0);
        assert_eq!(tree.bytes(0), 11); // "aaaa-" once, "old", "new"
        tree.evict(0, 10);
        tree.check_invariants();
        assert_eq!(tree.match_lengths(b"aaaa-old"), vec![5]); // the shared "aaaa-" stays
        assert_eq!(tree.match_lengths(b"aaaa-new"), vec![8]);
        tree.evict(0, 0);
        tree.check_invariants();
        assert_eq!(tree.num_nodes(), 1);
    }

    #[test]
    fn removing_a_replica_keeps_the_others() {
        let mut tree = PrefixTree::new(2);
        tree.insert(b"shared prefix one", 0);
        tree.insert(b"shared prefix two", 1);
        tree.remove_replica(0);
        tree.check_invariants();
        assert_eq!(tree.match_lengths(b"shared prefix one"), vec![0, 14]);
        assert_eq!(tree.bytes(0), 0);
    }

    proptest! {
        #[test]
        fn invariants_hold_under_any_sequence(
            ops in proptest::collection::vec((0usize..3, "[ab]{0,12}", 0u8..4), 1..80)
        ) {
            let mut tree = PrefixTree::new(3);
            let mut routed: Vec<Vec<String>> = vec![Vec::new(); 3];
            for (replica, text, op) in ops {
                match op {
                    0 | 1 => {
                        tree.insert(text.as_bytes(), replica);
                        routed[replica].push(text.clone());
                    }
                    2 => tree.evict(replica, text.len()),
                    _ => {
                        tree.remove_replica(replica);
                        routed[replica].clear();
                    }
                }
                tree.check_invariants();
                // Never more than what was routed: a match is a prefix of some text sent there.
                let m = tree.match_lengths(text.as_bytes());
                for r in 0..3 {
                    let best = routed[r].iter().map(|t| common_prefix(t.as_bytes(), text.as_bytes())).max().unwrap_or(0);
                    prop_assert!(m[r] <= best);
                }
            }
        }
    }
}
