"""Decode steps replayed from captured graphs (model/decode_graphs.py), on the CPU: a stand-in
capture records the forward and a replay reruns it on the buffers' current contents, so these
tests check what makes a real CUDA-graph replay right. The same greedy tokens as the eager path;
one capture per (batch, width) bucket; and every replay launches exactly the kernels its capture
did, with the same grids and scalars, on the same addresses of everything that outlives a step
(buffers, KV cache, weights, workspace): what a CUDA graph bakes in. The draft model's
one-token steps likewise. The real capture runs in
bench/gpu_check.py when a GPU is lent."""

from __future__ import annotations

from collections.abc import Container
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.kernels._launch import observing
from pyserve.model.attention import make_backend
from pyserve.model.config import ModelConfig
from pyserve.model.decode_graphs import DecodeGraphs
from pyserve.model.sampler import Sampler
from pyserve.model.step_buffers import StepBuffers
from pyserve.speculative.draft_model import DraftModelProposer
from pyserve.speculative.proposer import ProposalBatch

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]  # as a batch: 3 rows in a bucket of 4
CONFIG = dict(device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)  # tables of 1 to 4 blocks


class StandInCapture:
    """capture(forward): runs it once as the capture; replay() reruns it into the captured
    output. Records each launch's kernel, grid, scalars and the addresses of long-lived tensors."""

    def __init__(self):
        self.long_lived: Container[int] = ()  # storage addresses of what outlives a step
        self.captures: list[list[tuple]] = []
        self.replays: list[tuple[int, list[tuple]]] = []  # (index of the capture, its launches)

    def _traced(self, forward) -> tuple[torch.Tensor, list[tuple]]:
        launches = []

        def observe(name, grid, runtime, args):
            launches.append((name, tuple(grid), tuple(sorted(
                (k, self._address(v)) if isinstance(v, torch.Tensor) else (k, v) for k, v in args.items()))))

        with observing(observe):
            return forward(), launches

    def _address(self, t: torch.Tensor):
        return t.data_ptr() if t.untyped_storage().data_ptr() in self.long_lived else "a step's own"

    def __call__(self, forward):
        hidden, launches = self._traced(forward)
        index = len(self.captures)
        self.captures.append(launches)

        def replay():
            again, launches = self._traced(forward)
            hidden.copy_(again)
            self.replays.append((index, launches))

        return replay, hidden


class LongLived:
    """The storage addresses of what outlives a step, read when asked (a bucket's table buffer
    is made when a step first needs it)."""

    def __init__(self, worker, graphs: DecodeGraphs):
        self.worker, self.graphs = worker, graphs

    def __contains__(self, address: int) -> bool:
        worker, buffers, workspace = self.worker, self.graphs.buffers, self.graphs.backend.workspace
        tensors = [*worker.model.parameters(), *worker.model.buffers(), *(t for kv in worker.kv_caches for t in kv),
                   workspace._o, workspace._lse, buffers.query_start_loc]
        for pair in (buffers.input_ids, buffers.positions, buffers.slots, buffers.seq_lens, *buffers.tables.values()):
            tensors.extend(pair)
        return address in {t.untyped_storage().data_ptr() for t in tensors}


def with_graphs(llm: LLM, capture) -> DecodeGraphs:
    worker = llm.engine.worker
    graphs = worker.decode_graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.step_buffers, 16,
                                                 capture=capture)
    if isinstance(capture, StandInCapture):
        capture.long_lived = LongLived(worker, graphs)
    return graphs


@pytest.fixture(scope="module")
def eager_tokens(llama_dir):
    with LLM(str(llama_dir), **CONFIG) as llm:
        return {n: [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], PARAMS, use_tqdm=False)]
                for n in (1, 3)}


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_replayed_decode_steps_give_the_eager_tokens_and_launch_what_was_captured(llama_dir, eager_tokens,
                                                                                    num_prompts):
    with LLM(str(llama_dir), attention_backend="triton", **CONFIG) as llm:
        capture = StandInCapture()
        graphs = with_graphs(llm, capture)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:num_prompts], PARAMS, use_tqdm=False)]
    assert got == eager_tokens[num_prompts]
    # Decode contexts of 4-13 tokens alone (tables 1-4 blocks wide: buckets 1, 2 and 4), of 7-16
    # with the 6-token prompt in the batch (2 and 4); each bucket captured once.
    buckets = {(1, 1), (1, 2), (1, 4)} if num_prompts == 1 else {(4, 2), (4, 4)}
    assert set(graphs.graphs) == buckets
    assert len(capture.captures) == len(buckets)
    assert len(capture.replays) == 9 - len(buckets)  # 9 decode steps, the first of each bucket eager
    for index, launches in capture.replays:
        assert launches == capture.captures[index]
    activations = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}  # the graph's own, from its pool
    for launches in capture.captures:
        for _, _, args in launches:
            assert all(isinstance(value, int) for name, value in args if name.endswith("_ptr")
                       and name not in activations)  # every other tensor is long-lived
    assert capture.captures[0] and {name for name, *_ in capture.captures[0]} == {
        "_write_kv_cache_kernel", "_decode_stage1_kernel"}
    assert graphs.failed is None


def test_a_capture_that_fails_leaves_the_step_and_the_rest_eager(llama_dir, eager_tokens):
    calls = []

    def failing_capture(forward):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    with LLM(str(llama_dir), attention_backend="triton", **CONFIG) as llm:
        graphs = with_graphs(llm, failing_capture)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], PARAMS, use_tqdm=False)]
    assert got == eager_tokens[3]
    assert calls == [1] and graphs.graphs == {}
    assert "stream is capturing" in str(graphs.failed)


@pytest.mark.parametrize("max_blocks, splits", [(16, 1), (128, 2)])
def test_the_graphs_workspace_holds_the_largest_bucket_and_never_moves(llama_dir, max_blocks, splits):
    """4 q heads over 2 KV heads, blocks of 4 tokens, the interpreter's 8 "multiprocessors": up to
    64 keys take one split at every batch; up to 512 take two at batch 8 (2 x 8 programs of 4
    heads' 256 keys fill 32 slots)."""
    with LLM(str(llama_dir), attention_backend="triton", **CONFIG) as llm:
        worker = llm.engine.worker
        graphs = DecodeGraphs(worker.model, worker.kv_caches, StepBuffers(worker.device, 8), max_blocks,
                              capture=StandInCapture())
        workspace = graphs.backend.workspace
        before = workspace._o.data_ptr()
        assert workspace.views(8, 4, splits, 16, "cpu")[0].shape == (8, 4, splits, 16)
        workspace.views(1, 4, 8 * splits, 16, "cpu")
        assert workspace._o.data_ptr() == before
        with pytest.raises(ValueError, match="fixed workspace"):
            workspace.views(8, 4, splits + 1, 16, "cpu")


def test_graphs_are_for_cuda_the_cpus_triton_path_decodes_eagerly_on_the_buffers(llama_dir):
    with LLM(str(llama_dir), attention_backend="triton", **CONFIG) as llm:
        assert llm.engine.worker.step_buffers is not None and llm.engine.worker.decode_graphs is None


def test_the_drafts_one_token_steps_replay_graphs_with_the_eager_drafts(llama_dir):
    """The draft model's guesses after the first, fed one token a request, through its own
    graphs: the same guesses and KV cache as op by op, for one request then three (padded to 4)."""
    cfg = ModelConfig.from_dir(llama_dir)
    cpu = torch.device("cpu")

    def proposer():
        p = DraftModelProposer(str(llama_dir), cfg, dtype=torch.float32, device=cpu, num_blocks=64, block_size=4,
                               quantization=None, quantization_group_size=64, max_model_len=64,
                               backend=make_backend("triton"), sampler=Sampler(cfg.vocab_size, cpu, seed=0))
        p.whole_model = None  # every guess through the model's forward
        return p

    eager, graphed = proposer(), proposer()
    capture = StandInCapture()
    graphed.decode_graphs = DecodeGraphs(graphed.model, graphed.kv_caches, StepBuffers(cpu, 4), 16, capture=capture)
    capture.long_lived = ()  # launches compared by kernels, grids and scalars alone here
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 9, 3)]
    tables = np.zeros((3, 16), dtype=np.int32)
    tables[0, :4], tables[1, :4], tables[2, :4] = np.arange(1, 5), np.arange(5, 9), np.arange(9, 13)
    reqs = [SimpleNamespace(internal_id=i, params=SamplingParams(temperature=0.0)) for i in range(3)]
    for n in (1, 3):
        batch = ProposalBatch(reqs[:n], tables[:n], 4, [np.asarray(t, dtype=np.int64) for t in prompts[:n]])
        want, got = eager.propose(batch, [None] * n), graphed.propose(batch, [None] * n)
        assert got == want and all(len(g) == 4 for g in got)
        for p in (eager, graphed):
            p.accepted(0, 0)
    for (k1, v1), (k2, v2) in zip(eager.kv_caches, graphed.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert {b for b, _ in graphed.decode_graphs.graphs} == {1, 4} and capture.replays
    assert all(launches == capture.captures[i] for i, launches in capture.replays)
