"""The prompt logprobs of requests being prefilled, gathered chunk by chunk (EngineCore owns
them): row j holds prompt token j + 1's logprob given the tokens before it, its rank and the
top alternatives. A chunk recomputed after a preemption writes the same rows again."""

from __future__ import annotations

import numpy as np

from pyserve.step.request import Logprobs


class PromptLogprobs:
    def __init__(self, prompt_len: int, num_top: int):
        n = prompt_len - 1
        self.num_top = num_top
        self.rows = Logprobs(np.zeros((n, num_top), np.float32), np.zeros((n, num_top), np.int64),
                             np.zeros(n, np.float32), np.zeros(n, np.int64))
        self.filled = np.zeros(n, dtype=bool)

    def write(self, token_indices: np.ndarray, logprobs: Logprobs) -> None:
        """Rows for prompt tokens `token_indices` (each >= 1)."""
        rows = token_indices - 1
        self.rows.top[rows], self.rows.top_token_ids[rows] = logprobs.top, logprobs.top_token_ids
        self.rows.sampled[rows], self.rows.sampled_ranks[rows] = logprobs.sampled, logprobs.sampled_ranks
        self.filled[rows] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())
