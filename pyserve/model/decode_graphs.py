"""Decode steps replayed from CUDA graphs, so a small batch pays one launch a step instead of one
per kernel and op: the forward of a decode step is captured once per bucket of StepBuffers
(batch bucket B, block-table width bucket W), the first time a step of that bucket runs, and
replayed for every later one.

A replay computes the step's eager forward only if every launch it recorded is the one an eager
run of any step of its bucket makes: the same kernels, grids and scalar arguments (functions of
the bucket alone: the decode kernel's split count follows W, never the lengths), on the same
addresses. The inputs are StepBuffers' (filled before each replay); weights and the KV cache
never move; the decode kernel's workspace is this runner's own, allocated once for the largest
bucket (eager steps keep using the backend's, which may grow); activations live in one memory
pool the graphs share. So graphs replay one at a time, and a replay's hidden states are used
before the next replay.

A capture that fails is logged and the runner decodes eagerly, on the same buffers, from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from pyserve.kernels.paged_decode_attention import DecodeWorkspace, choose_num_splits, multiprocessor_count
from pyserve.model.attention import TritonBackend
from pyserve.model.step_buffers import StepBuffers, bucket

log = structlog.get_logger("pyserve.model")

# capture(forward) -> (replay, output): records `forward` (which returns the hidden states) so
# that `replay()` recomputes them into `output` from the buffers' current contents.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_graph_capture(pool) -> Capture:
    """Captures into a torch.cuda.CUDAGraph whose activations come from `pool`, after one run on a
    side stream (as torch's docs ask: libraries set up per-stream state on a first call, which a
    capture must not record). Only this thread's CUDA calls are barred during the capture (other
    threads may serve embeddings on the device meanwhile)."""
    def capture(forward):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()  # rewrites the KV the step's eager run wrote, with the same values
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            hidden = forward()
        return graph.replay, hidden
    return capture


@dataclass(slots=True)
class Captured:
    replay: Callable[[], None]
    hidden: torch.Tensor  # [B, hidden_size], rewritten by every replay


class DecodeGraphs:
    def __init__(self, model, kv_caches, buffers: StepBuffers, max_blocks: int, capture: Capture | None = None):
        """`max_blocks`: the widest block table a step can have; `capture`: CUDA graphs on the
        buffers' CUDA device by default (the tests pass a stand-in)."""
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        k_cache = kv_caches[0][0]
        block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        num_q_heads = model.config.num_heads
        sms = multiprocessor_count(buffers.device)
        widths = [1 << i for i in range(bucket(max_blocks).bit_length())]
        batches = [1 << i for i in range(buffers.max_batch.bit_length())]
        largest = max(b * num_q_heads * choose_num_splits(b, num_kv_heads, w * block_size, sms)
                      for b in batches for w in widths)
        self.backend = TritonBackend(DecodeWorkspace(fixed=(largest, head_dim, buffers.device)))
        self.capture = capture or cuda_graph_capture(torch.cuda.graph_pool_handle())
        self.graphs: dict[tuple[int, int], Captured] = {}
        self.failed: BaseException | None = None  # the capture error that turned graphs off

    def run(self, out) -> torch.Tensor:
        """The final hidden states of the rows of `out`, a decode-only SchedulerOutput (one
        token per request, every request with logits)."""
        input_ids, positions, meta, b = self.buffers.stage(out)
        n = len(out.input_ids)
        key = (b, meta.block_tables.shape[1])
        captured = self.graphs.get(key)
        if captured is not None:
            captured.replay()
            return captured.hidden[:n]

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

        hidden = forward()  # the step itself, eagerly; on a new bucket it also compiles what the capture records
        if self.failed is None:
            try:
                self.graphs[key] = Captured(*self.capture(forward))
            except Exception as error:  # noqa: BLE001 - any capture failure turns graphs off, the step stands
                self.failed = error
                log.warning("cuda_graphs_off", bucket=key, error=repr(error))
        return hidden[:n]
