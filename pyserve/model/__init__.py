"""Model execution: HF loading, the decoder family, KV tensors, attention backends, sampler."""
