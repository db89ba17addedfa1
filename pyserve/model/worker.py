"""ModelWorker: owns the device, the weights, the KV tensors and the sampler, and runs one step.

`execute` is synchronous and meant to run in a worker thread (torch releases the GIL), so the
event loop keeps serving while the forward runs. It is the only place, with the layers and the
kernels, where tensors exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pyserve.engine.request import EngineRequest
from pyserve.model.attention import AttentionMetadata, make_backend
from pyserve.model.config import ModelConfig
from pyserve.model.kv_cache import allocate_kv_cache, auto_num_blocks, copy_blocks
from pyserve.model.loader import load_model
from pyserve.model.sampler import Sampler, SamplingRows

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return dev


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # half precision matmuls are slow on CPUs
        return DTYPES.get(cfg.torch_dtype, torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@dataclass(slots=True)
class StepResult:
    """Sampled tokens, one per logits row, plus logprobs when any row asked for them."""

    token_ids: np.ndarray  # int64 [rows]
    logprobs: np.ndarray | None = None  # f32 [rows, K]
    logprob_token_ids: np.ndarray | None = None  # int64 [rows, K]
    sampled_logprobs: np.ndarray | None = None  # f32 [rows]
    sampled_ranks: np.ndarray | None = None  # int64 [rows]


class ModelWorker:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_model_len: int,
        seed: int = 0,
        gpu_memory_fraction: float = 0.85,
        attention_backend: str | None = None,
    ):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, cfg, self.device)
        self.config = cfg
        torch.manual_seed(seed)
        self.model = load_model(model_dir, cfg, self.dtype, self.device, max_model_len)
        if num_kv_blocks is None:
            num_kv_blocks = auto_num_blocks(cfg, block_size, self.dtype, self.device, gpu_memory_fraction)
        self.num_kv_blocks = num_kv_blocks
        self.kv_caches = allocate_kv_cache(cfg, num_kv_blocks, block_size, self.dtype, self.device)
        backend = attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.backend = make_backend(backend)
        self.sampler = Sampler(cfg.vocab_size, self.device, seed=seed)
        self._generators: dict[int, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out, rows: list[EngineRequest]) -> StepResult:
        """Runs the forward for one SchedulerOutput and samples one token per logits row; `rows`
        are the requests of those rows, in order."""
        for rid in out.finished_req_ids.tolist():
            self._generators.pop(rid, None)
        if out.num_reqs == 0:
            return StepResult(token_ids=np.empty(0, dtype=np.int64))
        dev = self.device
        copy_blocks(self.kv_caches, torch.from_numpy(out.block_copies).to(dev))
        meta = AttentionMetadata.build(
            out.slot_mapping, out.block_tables, out.seq_lens, out.query_start_loc, dev, self.backend.split_decode
        )
        input_ids = torch.from_numpy(out.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(out.positions).to(dev, non_blocking=True)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        if not rows:
            return StepResult(token_ids=np.empty(0, dtype=np.int64))
        logits_indices = torch.from_numpy(out.logits_indices).to(dev, non_blocking=True).long()
        logits = self.model.compute_logits(hidden[logits_indices])
        sampling = SamplingRows.build(
            [r.params for r in rows],
            [self._generator(r) for r in rows],
            [r.prompt_token_ids for r in rows],
            [r.output_token_ids for r in rows],
            [r.banned_token_ids() for r in rows],
            dev,
        )
        res = self.sampler.sample(logits, sampling)
        return StepResult(
            token_ids=res.token_ids.cpu().numpy(),
            logprobs=None if res.logprobs is None else res.logprobs.cpu().numpy(),
            logprob_token_ids=None if res.logprob_token_ids is None else res.logprob_token_ids.cpu().numpy(),
            sampled_logprobs=None if res.sampled_logprobs is None else res.sampled_logprobs.cpu().numpy(),
            sampled_ranks=None if res.sampled_ranks is None else res.sampled_ranks.cpu().numpy(),
        )

    def _generator(self, req: EngineRequest) -> torch.Generator | None:
        if req.params.seed is None or req.params.greedy:
            return None
        gen = self._generators.get(req.internal_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((req.params.seed + req.index) % (2**63))
            self._generators[req.internal_id] = gen
        return gen
