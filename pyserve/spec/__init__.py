"""Speculative decoding: configuration, proposers (n-gram lookup, draft model) and the adaptive
choice of how many tokens to guess per step. Verification lives with the sampler in the worker."""
