"""A Hugging Face encoder directory as an embedding model (pyserve.embeddings.encoder): a
transformers AutoModel, pooled as its sentence-transformers layout says (`1_Pooling/config.json`:
CLS token, mean of the tokens or last token; mean when the directory has none), then unit length.
Runs on the CPU in float32, a batch of inputs padded to its longest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pyserve.embeddings.encoder import unit_rows

POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
BATCH = 32


def pooling_mode(directory: Path) -> str:
    config = directory / "1_Pooling" / "config.json"
    if not config.is_file():
        return "mean"
    raw = json.loads(config.read_text())
    modes = [mode for key, mode in POOLING_KEYS.items() if raw.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{config}: exactly one of {', '.join(POOLING_KEYS)} must be set (pyserve pools one way)")
    return modes[0]


class HFEncoder:
    def __init__(self, directory: str | Path, name: str | None = None):
        from transformers import AutoModel, AutoTokenizer

        self.directory = Path(directory)
        self.name = name or self.directory.name
        self.source = str(self.directory)
        self.pooling = pooling_mode(self.directory)
        self._tokenizer = AutoTokenizer.from_pretrained(self.directory)
        self._model = AutoModel.from_pretrained(self.directory, dtype=torch.float32).eval()
        cfg = self._model.config
        self.dim = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        limit = getattr(cfg, "max_position_embeddings", None) or 512
        self.max_input_tokens = min(limit, self._tokenizer.model_max_length or limit)
        # Inputs are measured whole and refused past max_input_tokens (a 400 naming them): the
        # tokenizer's own warning for each long one would only be noise in the server's log.
        self._tokenizer.model_max_length = int(1e30)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [self._tokenizer(t, add_special_tokens=True, truncation=False)["input_ids"] for t in texts]

    @torch.inference_mode()
    def embed_ids(self, inputs: list[list[int]]) -> np.ndarray:
        out = np.zeros((len(inputs), self.dim), dtype=np.float32)
        pad = self._tokenizer.pad_token_id or 0
        for start in range(0, len(inputs), BATCH):
            chunk = inputs[start:start + BATCH]
            width = max(1, *(len(ids) for ids in chunk))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
                mask[row, :len(seq)] = 1
            hidden = self._model(input_ids=ids, attention_mask=mask).last_hidden_state
            out[start:start + len(chunk)] = self._pool(hidden, mask).numpy()
        return unit_rows(out)

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden[:, 0]
        lengths = mask.sum(dim=1)
        if self.pooling == "last":
            return hidden[torch.arange(hidden.shape[0]), (lengths - 1).clamp(min=0)]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / lengths.clamp(min=1).unsqueeze(-1).to(hidden.dtype)
