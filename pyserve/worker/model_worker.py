"""ModelWorker: owns the device, the weights, the KV tensors and the sampler, and runs one step:
inputs -> forward -> sample (drafts go to speculative.verify, adapters' slots to lora.slots).
`ModelWorker.from_config` builds it from the EngineConfig in named steps; the tensor-parallel
followers (follower.py) build their shards from the RankSpec rank 0 resolves the same way.

`execute` is synchronous; it runs inline on the EngineCore's loop, which the server gives a
thread of its own (torch and the Rust kernels release the GIL), so the server's loop keeps
serving while the forward runs. Tensors exist only here and in what runs inside
it (the layers, the kernels, the verifier, the draft model, the LoRA slots).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from pyserve.config import EngineConfig
from pyserve.lora.adapter import LoraError, load_adapter
from pyserve.lora.slots import LoraSlots
from pyserve.model.attention import AttentionMetadata, TorchBackend, make_backend
from pyserve.model.config import ModelConfig
from pyserve.model.cpu_linear import FEW_ROWS
from pyserve.model.decode_graphs import DecodeGraphs
from pyserve.model.kv_cache import allocate_kv_cache, auto_num_blocks, copy_blocks, move_slots
from pyserve.model.loader import load_model
from pyserve.model.noise import NoiseKey
from pyserve.model.quantized_linear import check_device, check_method, weight_bytes
from pyserve.model.sampler import Sampler, SamplingRows, token_logprobs
from pyserve.model.step_buffers import StepBuffers
from pyserve.model.token_masks import apply_token_masks
from pyserve.model.whole_model import WholeModel
from pyserve.parallel.group import torchrun_rank
from pyserve.parallel.launch import Followers
from pyserve.parallel.layers import local_config, shard_model
from pyserve.speculative.config import SpeculativeConfig
from pyserve.speculative.draft_model import DraftModelProposer
from pyserve.speculative.eagle import EagleProposer
from pyserve.speculative.eagle_config import HeadConfig
from pyserve.speculative.eagle_head import finish_head, load_head
from pyserve.speculative.proposer import DraftTree, ModelProposer, ProposalBatch
from pyserve.speculative.verify import Verifier
from pyserve.step.request import EngineRequest, Logprobs, PromptRows, StepResult, StepRows
from pyserve.worker.lockstep import Lockstep
from pyserve.worker.rank_setup import (attention_backend, check_parallel, finish_model, lora_slots, rank_spec,
                                       resolve_device, resolve_dtype)

PROMPT_LOGPROB_ROWS = 256  # prompt rows scored at once: a [rows, vocab] f32 block at a time


class ModelWorker:
    """The model's weights, KV cache, sampler and verifier on one device (rank 0 of a
    tensor-parallel group); built by `from_config`."""

    @staticmethod
    def runs_on_cpu(config: EngineConfig) -> bool:
        return resolve_device(config.device).type == "cpu"

    @classmethod
    def from_config(cls, config: EngineConfig, model_config: ModelConfig, *, model_dir: str, max_model_len: int,
                    speculative: SpeculativeConfig | None, draft_config: ModelConfig | None,
                    head_config: HeadConfig | None) -> ModelWorker:
        """The worker `config` asks for, serving the model at `model_dir` (`config.model` as the
        engine found it: a hub id is downloaded first) up to `max_model_len` tokens; with
        `speculative`, its verifier, and for a draft model the draft's `draft_config` (checked by
        the engine against the target's tokenizer), for an EAGLE-3 head its `head_config`
        (checked against the target). The build steps run in this order, each on what the ones
        before it set; a worker that fails to build leaves no rank behind."""
        worker = cls(config, model_config, max_model_len)
        if head_config is not None:
            if config.tensor_parallel_size > 1:
                raise ValueError("speculative_config.method: eagle3 is not served over tensor-parallel ranks")
            worker.head_config = head_config  # every target forward keeps the layers' inputs it reads
        with contextlib.ExitStack() as undo:
            worker._join_group(model_dir, undo)
            worker._load_weights(model_dir)
            worker._shard()
            worker._allocate_kv_cache()
            worker._build_step_parts()
            worker._attach_lora()
            worker._finish_model()
            worker._start_lockstep()
            worker._warm_up()
            worker._capture_decode_graphs()
            worker._build_speculation(speculative, draft_config)
            undo.pop_all()  # built: the group stays
        return worker

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        """What `config` asks for, resolved and checked before anything is built: the device,
        the dtype, the attention backend, the quantization method. Use `from_config`."""
        check_method(config.quantization, config.quantization_group_size)
        self.device = resolve_device(config.device)
        check_device(config.quantization, self.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.config = model_config
        self.engine_config = config
        self.max_model_len = max_model_len
        self.backend_name = attention_backend(config, self.device)
        self.max_lora_rank = config.max_lora_rank
        self.followers = self.group = None
        self.kv_config = model_config  # the KV cache's heads: the rank's share on a group (_shard)
        self.lora: LoraSlots | None = None
        self.decode_graphs: DecodeGraphs | None = None  # where decode steps replay CUDA graphs
        self.proposer: ModelProposer | None = None
        self.head_config: HeadConfig | None = None  # an EAGLE-3 head's (set by from_config)
        self.eagle: EagleProposer | None = None  # the head's proposer, told every step's features

    def _join_group(self, model_dir: str, undo: contextlib.ExitStack) -> None:
        """With tensor_parallel_size > 1: this process becomes rank 0 of a group whose other ranks
        (started here, or joined under torchrun) build their shards from the same RankSpec."""
        config, size = self.engine_config, self.engine_config.tensor_parallel_size
        if size == 1:
            return
        check_parallel(self.config, size, self.device, config.quantization)
        if torchrun_rank() is not None:
            self.followers, self.group = Followers.join_torchrun(size, self.device, config.distributed_timeout)
        else:
            spec = rank_spec(config, model_dir, self.max_model_len, self.dtype, self.backend_name)
            self.followers, self.group = Followers.start(size, spec, self.device, config.distributed_timeout)
        undo.callback(self._discard_group)

    def _load_weights(self, model_dir: str) -> None:
        """The checkpoint on the device (the generator seeded first, as on every rank); a
        checkpoint quantized already is not quantized again."""
        config = self.engine_config
        torch.manual_seed(config.seed)
        self.model = load_model(model_dir, self.config, self.dtype, self.device, self.max_model_len,
                                config.gguf_dequantize)
        if config.quantization is not None and self.model.checkpoint_quantization is not None:
            raise ValueError(f"quantization: the checkpoint is already quantized "
                             f"({self.model.checkpoint_quantization}); leave quantization unset")
        self.quantization = config.quantization or self.model.checkpoint_quantization  # None: full precision

    def _shard(self) -> None:
        """On a group: rank 0's slice of the model, split in place while its projections are
        still plain (unfused, unquantized)."""
        if self.group is not None:
            config = self.engine_config
            shard_model(self.model, self.group, config.quantization, config.quantization_group_size)
            self.kv_config = local_config(self.config, self.group.size)

    def _allocate_kv_cache(self) -> None:
        """`num_kv_blocks` blocks, or as many as the memory left now allows (NOTE: measured with
        the weights as loaded, before _finish_model quantizes them); every rank of a group holds
        as many blocks, of its own heads."""
        config = self.engine_config
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            num_blocks = auto_num_blocks(self.kv_config, config.block_size, self.dtype, self.device,
                                         config.gpu_memory_fraction, config.kv_cache_share)
        self.num_kv_blocks = num_blocks
        if self.group is not None:
            self.group.broadcast(torch.tensor([num_blocks], dtype=torch.int64, device=self.device))
        self.kv_caches = allocate_kv_cache(self.kv_config, num_blocks, config.block_size, self.dtype, self.device)

    def _build_step_parts(self) -> None:
        """The attention backend, the sampler and, on the Triton path, the fixed padded buffers
        of decode steps (graph-capturable; the CPU path's kernels take the step's own arrays)."""
        self.backend = make_backend(self.backend_name)
        triton = self.backend_name == "triton"
        self.step_buffers = StepBuffers(self.device, self.engine_config.max_num_seqs) if triton else None
        self.sampler = Sampler(self.config.vocab_size, self.device, seed=self.engine_config.seed)

    def _attach_lora(self) -> None:
        """LoRA slots wrap the base projections: before _finish_model, which then leaves them
        unfused and quantizes the wrapped base layers."""
        slots = lora_slots(self.engine_config)
        if slots:
            shard = (self.group.rank, self.group.size) if self.group is not None else (0, 1)
            self.lora = LoraSlots(self.model, slots, self.max_lora_rank, self.backend_name == "triton", shard)

    def _finish_model(self) -> None:
        config = self.engine_config
        finish_model(self.model, self.device, self.dtype, fuse=self.lora is None, quantization=config.quantization,
                     group_size=config.quantization_group_size)

    def _start_lockstep(self) -> None:
        """On a group: the finished model's forwards and logits announce themselves to the other
        ranks, which replay them on their shards."""
        if self.group is not None:
            self.model.lockstep = Lockstep(self.group, self.model, self.kv_caches, self.backend, self.lora,
                                           self.max_lora_rank)

    def _warm_up(self) -> None:
        """Steps of a few rows run the whole model in one call where every op has a CPU kernel;
        on CUDA's Triton path every kernel variant is compiled now, not in the first steps."""
        self.whole_model = WholeModel.of(self.model, self.kv_caches) \
            if isinstance(self.backend, TorchBackend) and self.backend.cpu_kernel else None
        if self.backend_name == "triton" and self.device.type == "cuda":
            self.backend.warm_up(*self.kv_caches[0], self.kv_config.num_heads)
            if self.lora is not None:
                self.lora.warm_up()

    def _capture_decode_graphs(self) -> None:
        """Decode steps replay CUDA graphs, except on rank 0 of a tensor-parallel group (each step
        is announced to the other ranks), in an engine serving LoRA (its steps run op by op) and
        under an EAGLE head (NOTE: the graphs do not keep the layer inputs it reads)."""
        if (self.step_buffers is not None and self.device.type == "cuda" and not self.engine_config.enforce_eager
                and self.group is None and self.lora is None and self.head_config is None):
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.step_buffers,
                                              -(-self.max_model_len // self.engine_config.block_size))

    def _build_speculation(self, speculative: SpeculativeConfig | None, draft_config: ModelConfig | None) -> None:
        """The draft model or EAGLE head (their KV blocks addressed as the target's), the
        verifier, and the target's served weight bytes (quantized or not)."""
        if self.head_config is not None:
            self.proposer = self.eagle = self._build_head(speculative.model)
        if draft_config is not None:
            self.proposer = DraftModelProposer(
                speculative.model, draft_config, dtype=self.dtype, device=self.device, num_blocks=self.num_kv_blocks,
                block_size=self.engine_config.block_size, max_model_len=self.max_model_len, backend=self.backend,
                sampler=self.sampler, quantization=self.engine_config.quantization,
                quantization_group_size=self.engine_config.quantization_group_size,
                graphs_for_batch=self.engine_config.max_num_seqs if self.decode_graphs is not None else None,
            )
        self.verifier = Verifier(self.sampler, self.device, self.proposer, noise_seed)
        self.weight_bytes = weight_bytes(self.model)
        if speculative is not None and self.device.type == "cuda":  # the rejection kernel's compile, now
            self.verifier.warm_up()

    def _build_head(self, path: str) -> EagleProposer:
        """The EAGLE-3 head at `path` (its own one-layer KV blocks addressed as the target's);
        every target forward from now on keeps the layer inputs it reads."""
        head, embedding = load_head(path, self.head_config, self.model, self.dtype, self.device, self.max_model_len)
        config = self.engine_config
        finish_head(head, config.quantization, config.quantization_group_size, self.device, self.dtype)
        self.model.aux_layer_ids = self.head_config.aux_layer_ids
        return EagleProposer(head, embedding, num_blocks=self.num_kv_blocks, block_size=self.engine_config.block_size,
                             max_model_len=self.max_model_len, backend=self.backend, sampler=self.sampler,
                             device=self.device, dtype=self.dtype)

    def on_failure(self, listener) -> None:
        """`listener(error)` is called (from another thread) if a tensor-parallel rank dies."""
        if self.followers is not None:
            self.followers.on_failure(listener)

    @property
    def parallel_stats(self) -> dict[str, float]:
        """Tensor-parallel figures (empty for one rank): the group's size and rank 0's seconds in
        collectives (broadcasts of the step's inputs, all-reduces, all-gathers)."""
        if self.group is None:
            return {}
        return {"tensor_parallel_size": self.group.size, "tensor_parallel_comm_seconds": self.group.comm_seconds}

    def abort_group(self, error: BaseException) -> None:
        """The engine failed: the tensor-parallel ranks are stopped at once (none may be left
        waiting in a collective)."""
        if self.followers is not None:
            self.followers.kill(error)

    def _discard_group(self) -> None:
        self.followers.kill(RuntimeError("the model worker failed to build"))
        self.group.close()
        self.followers.stop()
        self.group = None

    def close(self) -> None:
        """Stops the tensor-parallel ranks (nothing to do for one rank)."""
        if self.group is None:
            return
        try:
            if self.followers.failed is None:
                self.model.lockstep.stop()
        finally:
            self.group.close()
            self.followers.stop()
            self.group = None

    def add_lora(self, adapter_id: int, path: str) -> None:
        """Loads and validates a PEFT adapter on the CPU (a LoraError says why it was refused);
        it reaches a device slot when a step needs it."""
        if self.lora is None:
            raise LoraError("enable_lora: this engine was started without LoRA support")
        adapter = load_adapter(path, self.lora.shapes(), self.config.num_layers, self.max_lora_rank)
        self.lora.queue_add(adapter_id, adapter)

    def remove_lora(self, adapter_id: int) -> None:
        """Frees an adapter no request uses any more."""
        self.lora.queue_remove(adapter_id)

    @torch.inference_mode()
    def execute(self, out, rows: StepRows, adapter_ids: np.ndarray | None = None,
                prompt_rows: PromptRows | None = None) -> StepResult:
        """Runs the forward for one SchedulerOutput and samples: one token per request with
        logits, or for a request verifying drafts its accepted drafts and one more. `rows` are the
        requests with logits, in order; `adapter_ids` the LoRA adapter of every scheduled request
        (0 = the base model); `prompt_rows` the requests whose prompt tokens in this step get
        logprobs (StepResult.prompt_logprobs)."""
        result = self._execute(out, rows, adapter_ids, prompt_rows)
        if result.tree_paths:
            self._keep_paths(out, result.tree_paths)
        if self.eagle is not None and out.num_reqs:
            self.eagle.record(out, self.model.aux_hidden, result.num_sampled, result.token_ids, result.tree_paths)
        return result

    def copy_blocks(self, out) -> None:
        """The step's copies on write (`out.block_copies`, [src, dst] pairs), before anything
        writes the KV; also for a step that schedules no request (a prompt held whole by the cache,
        its last block matched in part)."""
        if not out.block_copies.size:
            return
        pairs = torch.from_numpy(out.block_copies).to(self.device)
        if self.model.lockstep is not None:
            self.model.lockstep.announce_copy_blocks(pairs)
        copy_blocks(self.kv_caches, pairs)
        if self.proposer is not None:
            self.proposer.copy_blocks(pairs)

    def _keep_paths(self, out, paths: dict[int, np.ndarray]) -> None:
        """Moves the KV of each token tree's kept rows to the slots after the request's last
        token, where the scheduler counts them (the tree puts its likeliest chain first, so
        when that chain was kept nothing moves)."""
        with_logits = np.flatnonzero(out.num_logits > 0)
        src, dst = [], []
        for i, path in paths.items():
            first = int(out.query_start_loc[with_logits[i]])
            moved = path != np.arange(len(path))
            src.append(out.slot_mapping[first + path[moved]])
            dst.append(out.slot_mapping[first + np.flatnonzero(moved)])
        if sum(map(len, src)):
            move_slots(self.kv_caches, np.concatenate(src), np.concatenate(dst))

    def _execute(self, out, rows: StepRows, adapter_ids: np.ndarray | None,
                 prompt_rows: PromptRows | None) -> StepResult:
        self.copy_blocks(out)
        if out.num_reqs == 0:
            return StepResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        dev = self.device
        if self.lora is not None:
            self.lora.prepare_step(adapter_ids, out.num_scheduled_tokens, dev)
            if self.model.lockstep is not None:  # the other ranks apply the same changes and map
                for adapter_id, path in self.lora.applied:
                    self.model.lockstep.announce_lora(adapter_id, path)
                self.model.lockstep.adapter_ids = adapter_ids
        if self.step_buffers is not None and self.lora is None and len(out.input_ids) == out.num_reqs \
                and len(rows.requests) == out.num_reqs and prompt_rows is None:  # a decode step, on the fixed buffers
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(out)
            else:
                input_ids, positions, meta, _ = self.step_buffers.stage(out)
                hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)[:out.num_reqs]
            return self._sample(self._logits(hidden, rows)[0], rows)
        if self.whole_model is not None and prompt_rows is None and len(out.input_ids) <= FEW_ROWS \
                and not len(out.tree_parents):  # its rows' slots follow their positions: no tree
            logits = self.whole_model.forward(out.input_ids, out.positions,
                                              np.repeat(np.arange(out.num_reqs), np.diff(out.query_start_loc)),
                                              out.block_tables, out.logits_indices)
            if not rows.requests:
                return StepResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
            return self._sample_logits(out, rows, logits)
        meta = AttentionMetadata.build(
            out.slot_mapping, out.block_tables, out.seq_lens, out.query_start_loc, dev, out.tree_parents
        )
        input_ids = torch.from_numpy(out.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(out.positions).to(dev, non_blocking=True)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        prompt_logprobs = None if prompt_rows is None else self._prompt_logprobs(hidden, out, prompt_rows)
        if not rows.requests:
            return StepResult(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64),
                              prompt_logprobs=prompt_logprobs)
        result = self._sample_hidden(out, rows, hidden)
        result.prompt_logprobs = prompt_logprobs
        return result

    def _sample_hidden(self, out, rows: StepRows, hidden: torch.Tensor) -> StepResult:
        """The step's tokens from the hidden states of all its scheduled tokens."""
        dev = self.device
        if len(out.logits_indices) != len(out.input_ids):
            hidden = hidden[torch.from_numpy(out.logits_indices).to(dev, non_blocking=True).long()]
        return self._sample_logits(out, rows, self.model.compute_logits(hidden))  # else every token has logits

    def _sample_logits(self, out, rows: StepRows, logits: torch.Tensor) -> StepResult:
        """The step's tokens from the logits of its rows that have logits, in order."""
        masks = self._apply_masks(logits, rows)
        if out.num_logits.max() == 1:  # one logits row per entry of `rows`
            return self._sample(logits, rows)
        counts = out.num_logits[out.num_logits > 0].astype(np.int64)  # logits rows per entry of `rows`
        certain = masks.certain if masks is not None else frozenset()
        return self.verifier.sample_and_verify(out, logits, rows, counts, self._sample, certain)

    def _prompt_logprobs(self, hidden: torch.Tensor, out, prompt_rows: PromptRows) -> list[tuple[np.ndarray, Logprobs]]:
        """For each request of `prompt_rows`: the prompt tokens its scheduled tokens predict
        (token p + 1 from position p, within the prompt) and their raw logprobs, ranks and top
        alternatives."""
        results = []
        for i, prompt, k in zip(prompt_rows.index, prompt_rows.prompts, prompt_rows.num_top, strict=True):
            lo, hi = int(out.query_start_loc[i]), int(out.query_start_loc[i + 1])
            positions = out.positions[lo:hi].astype(np.int64)
            keep = np.flatnonzero(positions + 1 < len(prompt))
            targets = positions[keep] + 1
            if not len(keep):
                results.append((targets, None))
                continue
            rows = hidden[lo:hi][torch.from_numpy(keep).to(hidden.device)]
            target_ids = torch.tensor(prompt, device=rows.device)[torch.from_numpy(targets).to(rows.device)]
            parts = [self._token_logprobs(rows[j : j + PROMPT_LOGPROB_ROWS], target_ids[j : j + PROMPT_LOGPROB_ROWS], k)
                     for j in range(0, len(rows), PROMPT_LOGPROB_ROWS)]
            results.append((targets, Logprobs(*(np.concatenate(a) for a in zip(*parts)))))
        return results

    def _token_logprobs(self, hidden: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[np.ndarray, ...]:
        """(top-k values, their ids, the tokens' own logprobs, their ranks) of raw logprobs."""
        raw = torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)
        return tuple(t.cpu().numpy() for t in token_logprobs(raw, token_ids, k))

    def _logits(self, hidden: torch.Tensor, rows: StepRows):
        """The logits of `hidden`, with the grammar masks of constrained rows applied, and
        those masks (None when no row is constrained)."""
        logits = self.model.compute_logits(hidden)
        return logits, self._apply_masks(logits, rows)

    @staticmethod
    def _apply_masks(logits: torch.Tensor, rows: StepRows):
        """Applies the grammar masks of constrained rows to `logits` in place; returns them (None
        when no row is constrained)."""
        if rows.token_masks is None:
            return None
        masks = rows.token_masks.result()
        apply_token_masks(logits, masks)
        return masks

    def _sample(self, logits: torch.Tensor, rows: StepRows) -> StepResult:
        """One token per row of `logits`, row i for rows.requests[i]."""
        reqs, num_output = rows.requests, rows.num_output
        if all(r.argmax_from == 0 or r.argmax_only(n) for r, n in zip(reqs, num_output)):
            # The common greedy batch: no sampling state. On the CPU numpy's argmax (the first
            # largest, as torch's) takes 2 us where torch's dispatch takes 9 (one row of 4096).
            cpu = logits.device.type == "cpu"
            best = logits.numpy().argmax(axis=-1) if cpu else logits.argmax(dim=-1).cpu().numpy()
            return StepResult(best, np.ones(len(reqs), dtype=np.int64))
        sampling = SamplingRows.build(
            [r.params for r in reqs],
            [noise_key(r, len(r.prompt_token_ids) + n) for r, n in zip(reqs, num_output)],
            [r.prompt_token_ids for r in reqs],
            rows.output_token_ids or [()] * len(reqs),
            [r.banned_token_ids(n) for r, n in zip(reqs, num_output)],
            self.device,
        )
        res = self.sampler.sample(logits, sampling)
        logprobs = None
        if res.logprobs is not None:
            logprobs = Logprobs(res.logprobs.cpu().numpy(), res.logprob_token_ids.cpu().numpy(),
                                res.sampled_logprobs.cpu().numpy(), res.sampled_ranks.cpu().numpy())
        return StepResult(res.token_ids.cpu().numpy(), np.ones(len(reqs), dtype=np.int64), logprobs)

    def propose(self, batch: ProposalBatch) -> list[list[int] | DraftTree]:
        """Draft tokens from the worker's proposer (a draft model or an EAGLE head), on the EngineCore's thread."""
        return self.proposer.propose(batch, [noise_seed(r) for r in batch.requests])


def noise_seed(req: EngineRequest) -> int | None:
    """The seed of a seeded sampled request's keyed noise (each of n samples its own), else None."""
    if req.params.seed is None or req.params.greedy:
        return None
    return (req.params.seed + req.index) % (2**63)


def noise_key(req: EngineRequest, position: int) -> NoiseKey | None:
    """The key of the draws for the token at sequence index `position` of `req` (None: unseeded)."""
    seed = noise_seed(req)
    return None if seed is None else NoiseKey(seed, position)
