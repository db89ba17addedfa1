//! The routing policy over the replicas: who is healthy, how many requests each has in flight,
//! and the prefix tree of what each was sent.

use std::fmt;

use crate::prefix_tree::{PrefixTree, ReplicaId};

/// How requests are spread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// By prefix match while loads are balanced, by load otherwise.
    CacheAware,
    /// In turn over the healthy replicas (the baseline the benchmarks compare against).
    RoundRobin,
}

#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub policy: Policy,
    /// The share of a request's text (0-1) a replica must already hold to be chosen for it.
    pub cache_threshold: f64,
    /// Loads count as imbalanced when the most loaded replica has more than this many requests
    /// in flight beyond the least loaded one...
    pub balance_abs_threshold: usize,
    /// ...and more than this multiple of its load.
    pub balance_rel_threshold: f64,
    /// Bytes of routed text kept per replica; the oldest leaves go first beyond it.
    pub max_tree_bytes: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: Policy::CacheAware,
            cache_threshold: 0.5,
            balance_abs_threshold: 16,
            balance_rel_threshold: 1.5,
            max_tree_bytes: 64 << 20,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Why a replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It holds at least `cache_threshold` of the request's text.
    CacheMatch,
    /// No replica held enough: the one with the least text cached.
    LeastCached,
    /// Loads were imbalanced: the least loaded.
    LeastLoaded,
    RoundRobin,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CacheMatch => "cache_match",
            Reason::LeastCached => "least_cached",
            Reason::LeastLoaded => "least_loaded",
            Reason::RoundRobin => "round_robin",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub replica: ReplicaId,
    pub reason: Reason,
    /// Bytes of the text the chosen replica was known to hold.
    pub matched_bytes: usize,
}

#[derive(Debug)]
pub struct ReplicaRouter {
    config: RouterConfig,
    tree: PrefixTree,
    loads: Vec<usize>,
    healthy: Vec<bool>,
    next_turn: usize,
}

impl ReplicaRouter {
    /// All replicas start healthy with nothing in flight.
    pub fn new(num_replicas: usize, config: RouterConfig) -> Result<Self, ConfigError> {
        if num_replicas == 0 {
            return Err(ConfigError("num_replicas must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&config.cache_threshold) {
            return Err(ConfigError(format!(
                "cache_threshold must be in [0, 1], got {}",
                config.cache_threshold
            )));
        }
        if config.balance_rel_threshold.is_nan() || config.balance_rel_threshold < 1.0 {
            return Err(ConfigError(format!(
                "balance_rel_threshold must be at least 1, got {}",
                config.balance_rel_threshold
            )));
        }
        Ok(Self {
            config,
            tree: PrefixTree::new(num_replicas),
            loads: vec![0; num_replicas],
            healthy: vec![true; num_replicas],
            next_turn: 0,
        })
    }

    pub fn num_replicas(&self) -> usize {
        self.loads.len()
    }

    /// Picks a healthy replica for a request whose text is `text` and counts it in flight there
    /// (until [`ReplicaRouter::finished`]); `None` when no replica is healthy.
    pub fn route(&mut self, text: &[u8]) -> Option<Decision> {
        self.route_excluding(text, &[])
    }

    /// As [`ReplicaRouter::route`], never choosing a replica in `excluded` (those a retry has
    /// already failed on).
    pub fn route_excluding(&mut self, text: &[u8], excluded: &[ReplicaId]) -> Option<Decision> {
        let candidates: Vec<ReplicaId> =
            (0..self.num_replicas()).filter(|r| self.healthy[*r] && !excluded.contains(r)).collect();
        if candidates.is_empty() {
            return None;
        }
        let decision = match self.config.policy {
            Policy::RoundRobin => self.in_turn(&candidates, text),
            Policy::CacheAware => self.cache_aware(&candidates, text),
        };
        self.loads[decision.replica] += 1;
        self.tree.insert(text, decision.replica);
        self.tree.evict(decision.replica, self.config.max_tree_bytes);
        Some(decision)
    }

    /// A request sent to `replica` has ended (answered, failed or abandoned).
    pub fn finished(&mut self, replica: ReplicaId) {
        self.loads[replica] = self.loads[replica].saturating_sub(1);
    }

    /// Marks `replica` up or down; a replica going down loses its tree (a restarted server's
    /// cache is empty) and stops receiving requests.
    pub fn set_healthy(&mut self, replica: ReplicaId, healthy: bool) {
        if self.healthy[replica] && !healthy {
            self.tree.remove_replica(replica);
        }
        self.healthy[replica] = healthy;
    }

    pub fn is_healthy(&self, replica: ReplicaId) -> bool {
        self.healthy[replica]
    }

    pub fn load(&self, replica: ReplicaId) -> usize {
        self.loads[replica]
    }

    pub fn tree_bytes(&self, replica: ReplicaId) -> usize {
        self.tree.bytes(replica)
    }

    fn in_turn(&mut self, candidates: &[ReplicaId], text: &[u8]) -> Decision {
        let n = self.num_replicas();
        let replica = (0..n).map(|i| (self.next_turn + i) % n).find(|r| candidates.contains(r)).unwrap();
        self.next_turn = (replica + 1) % n;
        Decision {
            replica,
            reason: Reason::RoundRobin,
            matched_bytes: self.tree.match_lengths(text)[replica],
        }
    }

    fn cache_aware(&self, candidates: &[ReplicaId], text: &[u8]) -> Decision {
        let matched = self.tree.match_lengths(text);
        let least_loaded = *candidates.iter().min_by_key(|&&r| (self.loads[r], r)).unwrap();
        let most = candidates.iter().map(|&r| self.loads[r]).max().unwrap();
        let least = self.loads[least_loaded];
        let imbalanced = most - least > self.config.balance_abs_threshold
            && most as f64 > least as f64 * self.config.balance_rel_threshold;
        if imbalanced {
            return Decision {
                replica: least_loaded,
                reason: Reason::LeastLoaded,
                matched_bytes: matched[least_loaded],
            };
        }
        let best =
            *candidates.iter().min_by_key(|&&r| (std::cmp::Reverse(matched[r]), self.loads[r], r)).unwrap();
        if !text.is_empty() && matched[best] as f64 >= self.config.cache_threshold * text.len() as f64 {
            return Decision { replica: best, reason: Reason::CacheMatch, matched_bytes: matched[best] };
        }
        let roomiest = *candidates.iter().min_by_key(|&&r| (self.tree.bytes(r), self.loads[r], r)).unwrap();
        Decision { replica: roomiest, reason: Reason::LeastCached, matched_bytes: matched[roomiest] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(n: usize) -> ReplicaRouter {
        ReplicaRouter::new(n, RouterConfig { balance_abs_threshold: 2, ..RouterConfig::default() }).unwrap()
    }

    #[test]
    fn conversations_stick_to_their_replica() {
        let mut r = router(2);
        let a = r.route(b"SYSTEM A. user: one").unwrap();
        let b = r.route(b"SYSTEM B. user: two").unwrap();
        assert_ne!(a.replica, b.replica, "a cold request goes to the replica with the least cached");
        assert_eq!(b.reason, Reason::LeastCached);
        for matched in [19, 25, 25] {
            let next = r.route(b"SYSTEM A. user: one. more").unwrap();
            assert_eq!(
                (next.replica, next.reason, next.matched_bytes),
                (a.replica, Reason::CacheMatch, matched)
            );
            r.finished(next.replica);
        }
    }

    #[test]
    fn imbalance_sends_to_the_least_loaded() {
        let mut r = router(2);
        let first = r.route(b"same prompt").unwrap().replica;
        for _ in 0..2 {
            assert_eq!(r.route(b"same prompt").unwrap().replica, first);
        }
        // 3 in flight against 0: over both bounds.
        let d = r.route(b"same prompt").unwrap();
        assert_eq!((d.replica, d.reason), (1 - first, Reason::LeastLoaded));
    }

    #[test]
    fn a_down_replica_gets_nothing_and_loses_its_tree() {
        let mut r = router(2);
        let a = r.route(b"hello world").unwrap().replica;
        r.set_healthy(a, false);
        assert_eq!(r.tree_bytes(a), 0);
        for _ in 0..4 {
            assert_eq!(r.route(b"hello world").unwrap().replica, 1 - a);
        }
        r.set_healthy(1 - a, false);
        assert_eq!(r.route(b"hello world"), None);
    }

    #[test]
    fn retries_exclude_replicas_tried() {
        let mut r = router(3);
        let first = r.route(b"x").unwrap().replica;
        let second = r.route_excluding(b"x", &[first]).unwrap().replica;
        assert_ne!(first, second);
        assert_eq!(r.route_excluding(b"x", &[0, 1, 2]), None);
    }

    #[test]
    fn round_robin_takes_turns_over_healthy_replicas() {
        let config = RouterConfig { policy: Policy::RoundRobin, ..RouterConfig::default() };
        let mut r = ReplicaRouter::new(3, config).unwrap();
        r.set_healthy(1, false);
        let picks: Vec<_> = (0..4).map(|_| r.route(b"p").unwrap().replica).collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
    }

    #[test]
    fn bad_config_is_refused_naming_the_field() {
        let err = ReplicaRouter::new(2, RouterConfig { cache_threshold: 1.5, ..RouterConfig::default() })
            .unwrap_err();
        assert!(err.0.contains("cache_threshold"));
        assert!(ReplicaRouter::new(0, RouterConfig::default()).unwrap_err().0.contains("num_replicas"));
    }
}
