"""Speculative decoding: configuration, proposers (n-gram lookup, draft model) and the adaptive
choice of how many tokens to guess per step, and the verification of drafts (`verify`, run in
the model worker on the step's logits)."""
