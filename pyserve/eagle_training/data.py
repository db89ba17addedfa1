"""A head's training data, made by the target itself (self-distillation): its greedy and sampled
answers to the prompts, served by pyserve, then one prefill pass per sequence through the target's
layers recording what the head reads and predicts:

- `features` [n, 3 * H] (bfloat16): the residual stream entering the head's three layers;
- `tokens` [n]: the sequence;
- `labels` [n]: the target's argmax after each position (what a greedy verification accepts);
- `prompt_len`: where the answer starts (drafting happens there: the held-out figure reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pyserve.model.attention import AttentionMetadata, make_backend
from pyserve.model.checkpoint import load_config
from pyserve.model.kv_cache import allocate_kv_cache
from pyserve.model.loader import load_model
from pyserve.speculative.eagle_config import default_aux_layer_ids
from pyserve.worker.rank_setup import finish_model

BLOCK = 16
LOGIT_ROWS = 256  # positions projected on the vocabulary at once


@dataclass(slots=True)
class Sequence:
    features: torch.Tensor
    tokens: torch.Tensor
    labels: torch.Tensor
    prompt_len: int


def generate(model: str, prompts: list, *, chat: bool, max_tokens: int, samples: int, temperature: float,
             seed: int, max_len: int) -> list[tuple[list[int], int]]:
    """(token sequence, prompt length) of the target's greedy answer to each prompt and `samples`
    sampled ones, each sequence (prompt then answer) at most `max_len` tokens."""
    from pyserve import LLM, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)]
    params += [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(samples)]
    with LLM(model=model, seed=seed, max_model_len=max_len + max_tokens) as llm:
        tokenizer = llm.get_tokenizer()
        ids = []
        for p in prompts:
            if chat:
                messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
                ids.append(tokenizer.chat_prompt(messages))
            else:
                ids.append(tokenizer.encode(p) if isinstance(p, str) else p)
        ids = [i[: max_len - max_tokens] for i in ids]
        jobs = [(i, sp) for i in ids for sp in params]
        outs = llm.generate([j[0] for j in jobs], [j[1] for j in jobs], use_tqdm=True)
    return [([*o.prompt_token_ids, *o.outputs[0].token_ids][:max_len], len(o.prompt_token_ids)) for o in outs]


class Recorder:
    """The target's layers on the CPU in fp32 (as served there), run over one sequence at a time."""

    def __init__(self, model_dir: str, max_len: int, group_size: int):
        self.config = load_config(model_dir)
        self.aux_layer_ids = default_aux_layer_ids(self.config.num_layers)
        device, dtype = torch.device("cpu"), torch.float32
        self.model = load_model(model_dir, self.config, dtype, device, max_len, gguf_dequantize=False)
        finish_model(self.model, device, dtype, fuse=True, quantization=None, group_size=group_size)
        self.model.aux_layer_ids = self.aux_layer_ids
        self.num_blocks = -(-max_len // BLOCK) + 1  # block 0 stands for "none" in a table
        self.kv = allocate_kv_cache(self.config, self.num_blocks, BLOCK, dtype, device)
        self.backend = make_backend("torch")

    @torch.inference_mode()
    def record(self, tokens: list[int], prompt_len: int = 0) -> Sequence:
        n = len(tokens)
        slots = np.arange(BLOCK, BLOCK + n, dtype=np.int64)
        table = np.arange(1, self.num_blocks, dtype=np.int32)[None, :]
        meta = AttentionMetadata.build(slots, table, np.array([n], dtype=np.int32),
                                       np.array([0, n], dtype=np.int32), torch.device("cpu"))
        ids = torch.tensor(tokens, dtype=torch.int64)
        hidden = self.model(ids, torch.arange(n), self.kv, meta, self.backend)
        labels = torch.cat([self.model.compute_logits(hidden[i : i + LOGIT_ROWS]).argmax(dim=-1)
                            for i in range(0, n, LOGIT_ROWS)])
        return Sequence(self.model.aux_hidden.to(torch.bfloat16), ids.to(torch.int32), labels.to(torch.int32),
                        prompt_len)

    def embedding(self) -> torch.nn.Module:
        return self.model.model.embed_tokens

    def head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's head rows [len(token_ids), H] of the given tokens (whatever layer kind
        holds it: the head applied to the identity)."""
        with torch.inference_mode():
            eye = torch.eye(self.config.hidden_size)
            return self.model.lm_head(eye).float().T[token_ids].clone()
