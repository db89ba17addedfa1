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

from pyserve.engine.request import LOGPROB_FIELDS, EngineRequest
from pyserve.kernels.rejection_sample import rejection_sample, rejection_sample_ref
from pyserve.lora.adapter import LoraAdapter, LoraError, load_adapter
from pyserve.lora.slots import LoraSlots
from pyserve.model.attention import AttentionMetadata, make_backend
from pyserve.model.config import ModelConfig
from pyserve.model.kv_cache import allocate_kv_cache, auto_num_blocks, copy_blocks
from pyserve.model.loader import load_model
from pyserve.model.packed_linear import can_pack, pack_linears
from pyserve.model.sampler import Sampler, SamplingRows
from pyserve.spec.draft_model import DraftModelProposer
from pyserve.spec.proposer import ModelProposer, ProposalBatch

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
    """Sampled tokens per request row, plus logprobs (one row per token) when any row asked."""

    token_ids: np.ndarray  # int64, end to end: num_sampled[i] tokens for request row i
    num_sampled: np.ndarray  # int64 [rows]: 1, or accepted drafts + 1 for a verifying row
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
        draft_model: tuple[str, ModelConfig] | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 64,
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
        self.lora = LoraSlots(self.model, max_loras, max_lora_rank, backend == "triton") if max_loras else None
        if self.lora is None:
            self.model.fuse_projections()
        if can_pack(self.device, self.dtype):
            pack_linears(self.model)  # after LoRA wrapped its base projections: those get packed too
        self.max_lora_rank = max_lora_rank
        # Adapters added (or None: removed) since the last step; applied by the next step, in the
        # worker thread, so the slots never change under a running forward.
        self._lora_changes: list[tuple[int, LoraAdapter | None]] = []
        self.proposer: ModelProposer | None = None
        if draft_model is not None:
            self.proposer = DraftModelProposer(
                draft_model[0], draft_model[1], dtype=self.dtype, device=self.device, num_blocks=num_kv_blocks,
                block_size=block_size, max_model_len=max_model_len, backend=self.backend, sampler=self.sampler,
            )

    def add_lora(self, adapter_id: int, path: str) -> None:
        """Loads and validates a PEFT adapter on the CPU (a LoraError says why it was refused);
        it reaches a device slot when a step needs it."""
        if self.lora is None:
            raise LoraError("enable_lora: this engine was started without LoRA support")
        adapter = load_adapter(path, self.lora.shapes(), self.config.num_layers, self.max_lora_rank)
        self._lora_changes.append((adapter_id, adapter))

    def remove_lora(self, adapter_id: int) -> None:
        """Frees an adapter no request uses any more."""
        self._lora_changes.append((adapter_id, None))

    def _set_lora_slots(self, out, adapter_ids: np.ndarray | None) -> None:
        if self.lora is None:
            return
        while self._lora_changes:
            adapter_id, adapter = self._lora_changes.pop(0)
            if adapter is None:
                self.lora.remove(adapter_id)
            else:
                self.lora.add(adapter_id, adapter)
        if adapter_ids is None or not adapter_ids.any():
            self.lora.set_tokens(None)
            return
        slot_of = self.lora.activate(set(adapter_ids[adapter_ids > 0].tolist()))
        req_slots = np.array([slot_of.get(a, -1) for a in adapter_ids.tolist()], dtype=np.int64)
        token_slots = np.repeat(req_slots, out.num_scheduled_tokens)
        self.lora.set_tokens(torch.from_numpy(token_slots).to(self.device))

    @torch.inference_mode()
    def execute(self, out, rows: list[EngineRequest], adapter_ids: np.ndarray | None = None) -> StepResult:
        """Runs the forward for one SchedulerOutput and samples: one token per request with
        logits, or for a request verifying drafts its accepted drafts and one more. `rows` are the
        requests with logits, in order; `adapter_ids` the LoRA adapter of every scheduled request
        (0 = the base model)."""
        for rid in out.finished_req_ids.tolist():
            self._generators.pop(rid, None)
        if out.num_reqs == 0:
            return StepResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        dev = self.device
        if out.block_copies.size:
            pairs = torch.from_numpy(out.block_copies).to(dev)
            copy_blocks(self.kv_caches, pairs)
            if self.proposer is not None:
                self.proposer.copy_blocks(pairs)
        self._set_lora_slots(out, adapter_ids)
        meta = AttentionMetadata.build(
            out.slot_mapping, out.block_tables, out.seq_lens, out.query_start_loc, dev
        )
        input_ids = torch.from_numpy(out.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(out.positions).to(dev, non_blocking=True)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        if not rows:
            return StepResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        if len(out.logits_indices) != len(out.input_ids):
            hidden = hidden[torch.from_numpy(out.logits_indices).to(dev, non_blocking=True).long()]
        logits = self.model.compute_logits(hidden)  # else every token has logits, in order
        if out.num_logits.max() == 1:  # one logits row per entry of `rows`
            return self._sample(logits, rows)
        counts = out.num_logits[out.num_logits > 0].astype(np.int64)  # logits rows per entry of `rows`
        return self._sample_and_verify(out, logits, rows, counts)

    def _sample(self, logits: torch.Tensor, rows: list[EngineRequest]) -> StepResult:
        """One token per row of `logits`, row i for request rows[i]."""
        if all(r.argmax_from == 0 or r.argmax_only() for r in rows):  # the common greedy batch: no sampling state
            return StepResult(logits.argmax(dim=-1).cpu().numpy(), np.ones(len(rows), dtype=np.int64))
        sampling = SamplingRows.build(
            [r.params for r in rows],
            [self._generator(r) for r in rows],
            [r.prompt_token_ids for r in rows],
            [r.output_token_ids for r in rows],
            [r.banned_token_ids() for r in rows],
            self.device,
        )
        res = self.sampler.sample(logits, sampling)
        return StepResult(
            token_ids=res.token_ids.cpu().numpy(),
            num_sampled=np.ones(len(rows), dtype=np.int64),
            logprobs=None if res.logprobs is None else res.logprobs.cpu().numpy(),
            logprob_token_ids=None if res.logprob_token_ids is None else res.logprob_token_ids.cpu().numpy(),
            sampled_logprobs=None if res.sampled_logprobs is None else res.sampled_logprobs.cpu().numpy(),
            sampled_ranks=None if res.sampled_ranks is None else res.sampled_ranks.cpu().numpy(),
        )

    def _sample_and_verify(self, out, logits: torch.Tensor, rows: list[EngineRequest], counts: np.ndarray):
        """Rows with drafts (count > 1) go through rejection sampling, the others through the
        plain sampler. Tokens come back end to end, `num_sampled[i]` for rows[i]."""
        offsets = np.concatenate([[0], np.cumsum(counts)])
        plain = np.flatnonzero(counts == 1)
        spec = np.flatnonzero(counts > 1)
        per_row: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(rows)
        plain_result = None
        if len(plain):
            idx = torch.from_numpy(offsets[plain]).to(self.device)
            plain_result = self._sample(logits[idx], [rows[i] for i in plain])
            for j, i in enumerate(plain):
                per_row[i] = plain_result.token_ids[j : j + 1]
        spec_rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in spec])
        if all(rows[i].params.greedy for i in spec):
            accepted = self._verify_greedy(out, logits, rows, counts, spec, spec_rows)
        else:
            accepted = self._verify(out, logits, rows, counts, spec, spec_rows)
        for i, tokens in zip(spec, accepted):
            per_row[i] = tokens
        num_sampled = np.array([len(t) for t in per_row], dtype=np.int64)
        result = StepResult(token_ids=np.concatenate(per_row), num_sampled=num_sampled)
        if plain_result is not None and plain_result.logprobs is not None:
            flat = np.concatenate([[0], np.cumsum(num_sampled)])[plain]  # where each plain row's token sits
            n = int(num_sampled.sum())
            for name in LOGPROB_FIELDS:
                src = getattr(plain_result, name)
                full = np.zeros((n, *src.shape[1:]), dtype=src.dtype)  # spec rows never ask for logprobs
                full[flat] = src
                setattr(result, name, full)
        return result

    @staticmethod
    def _drafts(out, counts, spec, spec_rows) -> tuple[np.ndarray, np.ndarray]:
        """(the draft each logits row of `spec_rows` verifies, -1 on a request's last row; the
        requests' row offsets). Row r verifies the input token after its own position."""
        drafts = np.full(len(spec_rows), -1, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(counts[spec])]).astype(np.int32)
        for j in range(len(spec)):
            positions = out.logits_indices[spec_rows[cu[j] : cu[j + 1]]]
            drafts[cu[j] : cu[j + 1] - 1] = out.input_ids[positions[1:]]
        return drafts, cu

    def _verify_greedy(self, out, logits, rows, counts, spec, spec_rows) -> list[np.ndarray]:
        """Rejection sampling when every target is one-hot: drafts are kept while they equal the
        target's argmax, then comes the argmax. The draft model's q plays no part."""
        best = logits[torch.from_numpy(spec_rows).to(self.device)].argmax(dim=-1).cpu().numpy()
        drafts, cu = self._drafts(out, counts, spec, spec_rows)
        accepted = []
        for j, i in enumerate(spec):
            lo, hi = int(cu[j]), int(cu[j + 1])
            wrong = np.flatnonzero(drafts[lo : hi - 1] != best[lo : hi - 1])
            num_accepted = int(wrong[0]) if len(wrong) else hi - 1 - lo
            accepted.append(best[lo : lo + num_accepted + 1])
            if self.proposer is not None:
                self.proposer.take_draft_probs(rows[i].internal_id, int(counts[i]) - 1)
                self.proposer.accepted(rows[i].internal_id, num_accepted)
        return accepted

    def _verify(self, out, logits, rows, counts, spec, spec_rows) -> list[np.ndarray]:
        """Accepted drafts plus one token, per request of `spec` (rejection sampling)."""
        dev = self.device
        params = [rows[i].params for i in spec for _ in range(counts[i])]
        sampling = SamplingRows.build(params, [None] * len(params), [[]] * len(params), [[]] * len(params), None, dev)
        target = self.sampler.probs(logits[torch.from_numpy(spec_rows).to(dev)], sampling)
        drafts, cu = self._drafts(out, counts, spec, spec_rows)
        # Greedy rows need no randomness: with a one-hot target, u = 0 and unit noise make the
        # rule "keep drafts equal to the argmax, then the argmax".
        uniform = torch.zeros(len(spec_rows), device=dev)
        noise = torch.ones_like(target)
        shared = []
        for j, i in enumerate(spec):
            if rows[i].params.greedy:
                continue
            gen = self._generator(rows[i])
            if gen is None:
                shared.append(j)
                continue
            r0, r1 = int(cu[j]), int(cu[j + 1])
            uniform[r0:r1] = torch.rand(r1 - r0, generator=gen, device=dev)
            noise[r0:r1].exponential_(generator=gen)
        if shared:
            idx = torch.from_numpy(np.concatenate([np.arange(cu[j], cu[j + 1]) for j in shared])).to(dev)
            uniform[idx] = torch.rand(len(idx), generator=self.sampler.generator, device=dev)
            noise[idx] = torch.empty((len(idx), target.shape[1]), device=dev).exponential_(
                generator=self.sampler.generator)
        draft_probs = None
        if self.proposer is not None:
            zero = torch.zeros((1, target.shape[1]), device=dev)
            draft_probs = torch.cat([t for i in spec for t in (
                self.proposer.take_draft_probs(rows[i].internal_id, int(counts[i]) - 1), zero)])
        verify = rejection_sample if dev.type == "cuda" else rejection_sample_ref
        tokens, num = verify(target, draft_probs, torch.from_numpy(drafts).to(dev), uniform,
                             noise.clamp_min_(torch.finfo(torch.float32).tiny), torch.from_numpy(cu).to(dev))
        tokens, num = tokens.cpu().numpy(), num.cpu().numpy()
        if self.proposer is not None:
            for j, i in enumerate(spec):
                self.proposer.accepted(rows[i].internal_id, int(num[j]) - 1)
        return [tokens[cu[j] : cu[j] + num[j]] for j in range(len(spec))]

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        """Draft tokens from the worker's proposer (a draft model), in the worker thread."""
        return self.proposer.propose(batch, [self._generator(r) for r in batch.requests])

    def _generator(self, req: EngineRequest) -> torch.Generator | None:
        if req.params.seed is None or req.params.greedy:
            return None
        gen = self._generators.get(req.internal_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((req.params.seed + req.index) % (2**63))
            self._generators[req.internal_id] = gen
        return gen
