//! Paged decode attention for CPUs.
//!
//! One query token per sequence attends to the sequence's cached keys and values, read in place
//! from a paged cache through its block table: each cached row is read once, where a gather into
//! a padded dense tensor followed by a dense attention reads it twice and writes it once. On
//! CPUs, whose decode attention is bound by memory bandwidth, that is the whole cost. It runs on
//! the calling thread (see `kernel`), with AVX2 where the CPU has it.
//!
//! Layouts (row-major, f32): cache `[num_blocks, block_size, num_kv_heads, head_dim]` for keys
//! and values alike; queries and output `[num_seqs, num_q_heads, head_dim]`; block tables
//! `[num_seqs, table_width]`. Query head `h` reads kv head `h / (num_q_heads / num_kv_heads)`
//! (grouped-query attention). A sequence of length 0 gets zeros.

mod kernel;

pub use kernel::decode_attention;

/// The paged KV cache of one layer.
pub struct PagedCache<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// One decode step's sequences.
pub struct DecodeBatch<'a> {
    pub queries: &'a [f32],
    pub num_q_heads: usize,
    pub block_tables: &'a [i32],
    pub table_width: usize,
    pub seq_lens: &'a [i32],
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AttentionError {
    #[error("{0}")]
    Shape(String),
    #[error("sequence {seq}: length {len} needs more than the {capacity} slots of its block table")]
    TooLong { seq: usize, len: i64, capacity: usize },
    #[error("sequence {seq}: block id {block} is outside the cache's {num_blocks} blocks")]
    BlockOutOfRange { seq: usize, block: i64, num_blocks: usize },
}
