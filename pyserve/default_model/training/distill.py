"""Training the draft to agree with the target (knowledge distillation).

Speculative decoding keeps a draft token only when the target would have produced it, so the draft
is trained on the target's next-token distributions (forward KL, every position) rather than on the
corpus' tokens, and over two kinds of text in equal parts: corpus windows, and the target's own
greedy continuations of corpus prefixes, which is the text a draft meets while serving (the
target's habits, repetitions included, that no corpus shows).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def kl_to_teacher(teacher: torch.nn.Module):
    """loss_fn for `pretrain.train`: mean over positions of KL(teacher || student)."""

    def loss(student: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(input_ids=batch).logits.float().log_softmax(-1).flatten(0, 1)
        draft = student(input_ids=batch).logits.float().log_softmax(-1).flatten(0, 1)
        return F.kl_div(draft, target, log_target=True, reduction="batchmean")

    return loss


def target_continuations(target_dir: str, stream: np.ndarray, eot_id: int, *, count: int, prompt_len: int,
                         max_tokens: int, seed: int) -> np.ndarray:
    """`count` corpus prefixes of `prompt_len` tokens at random offsets, each followed by the
    target's greedy continuation (served by pyserve itself) and the end-of-text token, packed."""
    from pyserve import LLM, SamplingParams

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - prompt_len, size=count)
    prompts = [stream[s : s + prompt_len].tolist() for s in starts]
    with LLM(model=target_dir, seed=seed) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    parts = [np.asarray([*p, *o.outputs[0].token_ids, eot_id], dtype=np.int32) for p, o in zip(prompts, outs)]
    return np.concatenate(parts)
