//! CPU kernels pyserve runs between torch ops, with AVX2 and FMA where the CPU has them, on the
//! calling thread or on threads the caller lends (`ForkJoin`):
//! - `decode_attention`: paged decode attention, keys and values read in place from the cache;
//! - `add_lora`: multi-LoRA, every token's delta from its own adapter in one pass.

mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx2;
mod lora;
#[cfg(target_arch = "x86_64")]
mod lora_avx2;
mod parallel;
mod vector;

pub use attention::{decode_attention, decode_attention_on, AttentionError, DecodeBatch, PagedCache};
pub use lora::{add_lora, add_lora_on, LoraError, LoraWeights};
pub use parallel::{ForkJoin, OnCallingThread};
