"""Greedy parity with transformers: the reference continuation by full recomputation (no KV
cache) with the top-2 logit margin at every step, and the token-for-token comparison that lets
outputs part only where the reference itself was a near-tie."""

from __future__ import annotations

import random

MAX_TOKENS = 12
NEAR_TIE = 1e-4  # a divergence is accepted only where the reference's top-2 margin is this small


def prompts(vocab: int, seed: int = 0, lengths=(3, 17, 40, 9, 64, 1, 25)) -> list[list[int]]:
    """Random token-id prompts of the given lengths, ids in [2, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir, prompt_list, max_tokens=MAX_TOKENS, prepare=None):
    """Greedy continuation by full recomputation with transformers, plus the top-2 margin at
    every step. `prepare(model)`, if given, changes the loaded model in place first (a reference
    of pyserve's arithmetic that transformers does not have)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if prepare is not None:
        prepare(model)
    results = []
    with torch.no_grad():
        for prompt in prompt_list:
            ids = list(prompt)
            out, margins = [], []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                top = torch.topk(logits, 2)
                margins.append(float(top.values[0] - top.values[1]))
                out.append(int(top.indices[0]))
                ids.append(out[-1])
            results.append((out, margins))
    return results


def assert_parity(got: list[list[int]], ref, near_tie: float = NEAR_TIE) -> None:
    """`got` (token ids per prompt) equals `ref` (hf_greedy's results) up to the first position
    where the reference's top-2 margin is under `near_tie`, and has the same length where it never
    diverges."""
    for i, (tokens, (want, margins)) in enumerate(zip(got, ref, strict=True)):
        for j, (a, b) in enumerate(zip(tokens, want)):
            if a != b:
                assert margins[j] < near_tie, f"prompt {i}: token {j} is {a}, transformers says {b} " \
                                              f"(its margin {margins[j]:.2g})"
                break
        else:
            assert len(tokens) == len(want), f"prompt {i}: {len(tokens)} tokens, want {len(want)}"
