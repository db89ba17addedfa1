//! CPU kernels pyserve runs between torch ops, each on the calling thread (see `attention` for
//! why one thread), with AVX2 and FMA where the CPU has them:
//! - `decode_attention`: paged decode attention, keys and values read in place from the cache;
//! - `add_lora`: multi-LoRA, every token's delta from its own adapter in one pass.

mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx2;
mod lora;
#[cfg(target_arch = "x86_64")]
mod lora_avx2;
mod vector;

pub use attention::{decode_attention, AttentionError, DecodeBatch, PagedCache};
pub use lora::{add_lora, LoraError, LoraWeights};
