//! Scheduler configuration and its validation.

use crate::error::{config_err, Result};

/// Static limits of one scheduler. Build with [`SchedulerConfig::new`] then adjust fields and
/// call [`SchedulerConfig::validate`] (the [`crate::Scheduler`] constructor validates too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Blocks in the KV pool, including the reserved null block 0.
    pub num_blocks: usize,
    /// Tokens per block; a power of two.
    pub block_size: usize,
    /// Token budget of one step (all requests together, speculative tokens included).
    pub max_num_batched_tokens: usize,
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_model_len: usize,
    /// Most distinct LoRA adapters in one step; 0 disables adapters.
    pub max_loras: usize,
    /// Speculative lookahead: KV slots reserved per decoding request for draft tokens.
    pub num_lookahead_tokens: usize,
    /// Reuse KV of identical prefixes through the radix cache.
    pub enable_prefix_caching: bool,
}

impl SchedulerConfig {
    /// A config with the engine's defaults (pyserve's EngineConfig) for everything but the pool
    /// size; `max_model_len` is the engine's cap when a model allows more.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 8192,
            max_loras: 4,
            num_lookahead_tokens: 0,
            enable_prefix_caching: true,
        }
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        if self.num_blocks < 2 {
            return Err(config_err(
                "num_blocks",
                format!("must be at least 2 (block 0 is reserved), got {}", self.num_blocks),
            ));
        }
        if self.num_blocks > u32::MAX as usize {
            return Err(config_err("num_blocks", "must fit in 32 bits"));
        }
        if self.block_size == 0 || !self.block_size.is_power_of_two() || self.block_size > 1024 {
            return Err(config_err(
                "block_size",
                format!("must be a power of two in 1..=1024, got {}", self.block_size),
            ));
        }
        if self.max_num_batched_tokens < self.block_size {
            return Err(config_err(
                "max_num_batched_tokens",
                format!(
                    "must be at least block_size ({}), got {}",
                    self.block_size, self.max_num_batched_tokens
                ),
            ));
        }
        if self.max_num_seqs == 0 {
            return Err(config_err("max_num_seqs", "must be at least 1"));
        }
        if self.max_model_len < 2 {
            return Err(config_err("max_model_len", "must be at least 2"));
        }
        if self.num_lookahead_tokens >= self.max_num_batched_tokens {
            return Err(config_err(
                "num_lookahead_tokens",
                format!(
                    "must be below max_num_batched_tokens ({}), got {}",
                    self.max_num_batched_tokens, self.num_lookahead_tokens
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CoreError;

    fn field_of(config: &SchedulerConfig) -> Option<&'static str> {
        match config.validate() {
            Err(CoreError::InvalidConfig { field, .. }) => Some(field),
            _ => None,
        }
    }

    /// A field's name and a change that makes it invalid.
    type Spoiler = (&'static str, fn(&mut SchedulerConfig));

    #[test]
    fn defaults_are_valid_and_each_bad_field_is_named() {
        let ok = SchedulerConfig::new(64, 16);
        assert_eq!(field_of(&ok), None);
        let cases: [Spoiler; 6] = [
            ("num_blocks", |c| c.num_blocks = 1),
            ("block_size", |c| c.block_size = 12),
            ("max_num_batched_tokens", |c| c.max_num_batched_tokens = 8),
            ("max_num_seqs", |c| c.max_num_seqs = 0),
            ("max_model_len", |c| c.max_model_len = 1),
            ("num_lookahead_tokens", |c| c.num_lookahead_tokens = 2048),
        ];
        for (field, spoil) in cases {
            let mut c = ok.clone();
            spoil(&mut c);
            assert_eq!(field_of(&c), Some(field));
        }
    }
}
