//! CPU kernels pyserve runs between torch ops, with AVX2 and FMA where the CPU has them (and
//! AVX-512 for quantized weights), on the calling thread or on threads the caller lends (`ForkJoin`):
//! - `decode_attention`: paged decode attention, keys and values read in place from the cache;
//! - `add_lora`: multi-LoRA, every token's delta from its own adapter in one pass;
//! - `linear`: a linear layer over a few rows, its weights streamed once (`linear_q8`: int8
//!   weights; `linear_q4`: 4-bit weights in groups, on int16 activations; `linear_w8a8`: int8 weights and int8
//!   activations, exact integer sums; `linear_kquant`: a GGUF file's Q4_K, Q6_K and Q5_0 rows in place);
//! - `gguf_blocks`: a GGUF file's quantized rows converted to those layers' layouts at load;
//! - `layer_ops`: RMSNorm (with the residual add), the SiLU-gated product, rotary embedding;
//! - `decoder_layer`: a whole Llama-family layer over a few rows, the kernels above composed;
//! - `whole_model`: a whole model's forward over a few rows, and its greedy guesses several
//!   tokens ahead (a draft model);
//! - `eagle_draft`: an EAGLE-3 head's greedy guesses from the target's features.

mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx2;
mod decoder_layer;
mod eagle_draft;
mod gguf_blocks;
mod layer_ops;
mod linear;
#[cfg(target_arch = "x86_64")]
mod linear_avx2;
mod linear_kquant;
#[cfg(target_arch = "x86_64")]
mod linear_kquant_avx2;
mod linear_q4;
#[cfg(target_arch = "x86_64")]
mod linear_q4_avx2;
mod linear_q4_blocks;
#[cfg(target_arch = "x86_64")]
mod linear_q4_blocks_avx2;
#[cfg(target_arch = "x86_64")]
mod linear_q4k_vnni;
#[cfg(target_arch = "x86_64")]
mod linear_q5_avx2;
mod linear_q8;
mod linear_q8_0;
#[cfg(target_arch = "x86_64")]
mod linear_q8_0_avx2;
#[cfg(target_arch = "x86_64")]
mod linear_q8_avx512;
mod linear_w8a8;
mod lora;
#[cfg(target_arch = "x86_64")]
mod lora_avx2;
mod parallel;
mod projection;
mod vector;
mod whole_model;

pub use attention::{decode_attention, decode_attention_on, AttentionError, DecodeBatch, PagedCache};
pub use decoder_layer::{
    decoder_layer_on, layer_from_attention_input_on, Heads, LayerError, LayerWeights, PagedCacheMut,
    RowLayout,
};
pub use eagle_draft::{eagle_greedy_on, HeadWeights, Pairs};
pub use gguf_blocks::{repack_q4, requantize_int8, widen, BlockKind, BlocksError};
pub use layer_ops::{add_rms_norm, rms_norm, rotary, silu_mul, LayerOpError};
pub use linear::{linear, linear_on, LinearError, LinearWeights};
pub use linear_kquant::{linear_kquant, linear_kquant_on, KQuantWeights};
pub use linear_q4::{linear_q4, linear_q4_on, Q4Weights};
pub use linear_q8::{linear_q8, linear_q8_on, Q8Weights};
pub use linear_w8a8::{linear_w8a8, linear_w8a8_on, W8A8Weights};
pub use lora::{add_lora, add_lora_on, LoraError, LoraWeights};
pub use parallel::{ForkJoin, OnCallingThread};
pub use projection::{project_on, Projection};
pub use whole_model::{
    greedy_decode_on, model_forward_on, BlockTables, Embedding, Feed, ForwardOutput, ModelWeights, RopeTables,
};
