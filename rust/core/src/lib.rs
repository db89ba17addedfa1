//! # pyserve-core
//!
//! The scheduling core of the pyserve LLM serving engine, in plain Rust: a paged KV
//! [`BlockPool`], a token-exact [`RadixCache`] for prefix sharing, the [`KvCacheManager`] that
//! joins them, and the per-step [`Scheduler`] (continuous batching, chunked prefill,
//! prefix-aware admission, preemption by recompute, priorities, a LoRA cap per step and
//! speculative lookahead). It knows nothing of tensors or Python: integers in, plain structs and
//! flat arrays out.
//!
//! A step is `schedule` → run the model on the returned arrays → `update` with the sampled
//! tokens:
//!
//! ```
//! use pyserve_core::{NewRequest, Scheduler, SchedulerConfig};
//!
//! let mut config = SchedulerConfig::new(64, 4); // 64 blocks of 4 tokens
//! config.max_num_batched_tokens = 8;
//! let mut sched = Scheduler::new(config).unwrap();
//! let mut req = NewRequest::new(7, vec![1, 2, 3, 4, 5, 6]);
//! req.max_tokens = Some(2);
//! sched.add_request(req).unwrap();
//!
//! let out = sched.schedule().unwrap();
//! assert_eq!(out.input_ids, vec![1, 2, 3, 4, 5, 6]); // the whole prompt fits the budget
//! assert_eq!(out.positions, vec![0, 1, 2, 3, 4, 5]);
//! assert_eq!(out.slot_mapping, vec![4, 5, 6, 7, 8, 9]); // blocks 1 and 2
//! assert_eq!(out.logits_indices, vec![5]); // sample after the last prompt token
//! sched.update(&[42], &[1]).unwrap();
//!
//! let out = sched.schedule().unwrap(); // one decode token
//! assert_eq!((out.input_ids.clone(), out.positions.clone()), (vec![42], vec![6]));
//! let result = sched.update(&[43], &[1]).unwrap();
//! assert_eq!(result.finished.len(), 1); // max_tokens reached
//! assert!(!sched.has_unfinished_requests());
//! ```

pub mod block_pool;
pub mod config;
pub mod error;
pub mod kv_manager;
pub mod ngram;
pub mod output;
pub mod radix;
pub mod request;
pub mod request_table;
pub mod scheduler;

pub use block_pool::{BlockId, BlockPool, NULL_BLOCK};
pub use config::SchedulerConfig;
pub use error::{CoreError, Result};
pub use kv_manager::KvCacheManager;
pub use output::{ScheduledRequest, SchedulerOutput, UpdateResult};
pub use radix::{Namespace, NodeId, PrefixMatch, RadixCache};
pub use request::{FinishReason, NewRequest, Request, RequestId, RequestStatus};
pub use scheduler::{Scheduler, SchedulerStats, BACKGROUND_PRIORITY, MAX_TREE_DRAFTS};
