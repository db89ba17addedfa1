//! # pyserve-router
//!
//! Routing of LLM requests over data-parallel replicas so that a request lands where its prompt's
//! prefix is most likely still in the KV cache. The router never sees tokens (replicas may
//! tokenize differently), so it keeps a [`PrefixTree`] of the *text* it sent to each replica, an
//! approximation of each replica's prefix cache, bounded and aged per replica.
//!
//! [`ReplicaRouter`] applies the policy: while the replicas' loads (requests in flight) are
//! balanced, a request goes to the replica whose tree matches the longest share of its text, or,
//! below a threshold share, to the replica with the least text cached; once the loads drift apart
//! past both an absolute and a relative bound, to the least loaded replica.
//!
//! ```
//! use pyserve_router::{Reason, ReplicaRouter, RouterConfig};
//!
//! let mut router = ReplicaRouter::new(2, RouterConfig::default()).unwrap();
//! let first = router.route(b"You are a helpful assistant. Hello").unwrap();
//! router.finished(first.replica);
//! let again = router.route(b"You are a helpful assistant. How are you?").unwrap();
//! assert_eq!(again.replica, first.replica);
//! assert_eq!(again.reason, Reason::CacheMatch);
//! ```

pub mod prefix_tree;
pub mod replica_router;

pub use prefix_tree::{PrefixTree, ReplicaId};
pub use replica_router::{ConfigError, Decision, Policy, Reason, ReplicaRouter, RouterConfig};
