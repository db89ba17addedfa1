"""Next-token training of a Llama-architecture model (and LoRA fine-tuning through PEFT) on a
packed token stream, with a fixed seed so a rerun on the same machine gives the same weights."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Schedule:
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int = 50
    final_lr_fraction: float = 0.1

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.final_lr_fraction + (1 - self.final_lr_fraction) * cosine)

    @property
    def tokens(self) -> int:
        return self.steps * self.batch * self.seq_len


def encode_stream(tok, docs: list[str], eot_id: int) -> np.ndarray:
    """All documents' tokens, each document followed by the end-of-text token."""
    parts = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([eot_id], dtype=np.int32))
    return np.concatenate(parts)


def random_windows(streams: list[np.ndarray], schedule: Schedule, seed: int):
    """`schedule.steps` batches of windows at uniformly random offsets; the batch's rows are
    shared equally between the streams (the first ones take the remainder)."""
    rng = np.random.default_rng(seed)
    rows = [len(part) for part in np.array_split(np.arange(schedule.batch), len(streams))]
    for _ in range(schedule.steps):
        windows = []
        for stream, n in zip(streams, rows):
            starts = rng.integers(0, len(stream) - schedule.seq_len, size=n)
            windows += [stream[s : s + schedule.seq_len] for s in starts]
        yield torch.from_numpy(np.stack(windows).astype(np.int64))


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def train(model: torch.nn.Module, stream: np.ndarray | list[np.ndarray], schedule: Schedule, seed: int, label: str,
          loss_fn=next_token_loss) -> dict:
    """AdamW with warmup and cosine decay on windows of `stream` (or of several streams mixed
    equally in every batch), minimizing `loss_fn(model, batch)`; returns what the model card
    reports."""
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=schedule.lr, betas=(0.9, 0.95),
    )
    model.train()
    start, recent = time.perf_counter(), []
    streams = stream if isinstance(stream, list) else [stream]
    for step, batch in enumerate(random_windows(streams, schedule, seed)):
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == schedule.steps:
            elapsed = time.perf_counter() - start
            rate = (step + 1) * schedule.batch * schedule.seq_len / elapsed
            print(f"[{label}] step {step + 1}/{schedule.steps} loss {np.mean(recent[-50:]):.3f} "
                  f"{rate:,.0f} tok/s {elapsed:,.0f} s", flush=True)
    model.eval()
    return {
        "train_tokens": schedule.tokens, "train_seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": round(float(np.mean(recent[-50:])), 4), "steps": schedule.steps,
        "batch": schedule.batch, "seq_len": schedule.seq_len, "lr": schedule.lr,
    }
