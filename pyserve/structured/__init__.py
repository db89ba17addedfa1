"""Structured output: constraints (params), their compile into llguidance grammars (compiler) and
the per-request matchers the EngineCore advances and masks with (matchers)."""
