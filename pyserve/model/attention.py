"""Attention over the paged KV cache, behind one interface with two backends.

`torch` is the CPU path: the kernels' torch references, and for fp32 caches a CPU kernel (Rust)
that attends decode rows and short queries with the pages read in place; `triton` runs the Triton
kernels (the CUDA path). Both take the same paged arguments, so the model never branches on the
device. Each forward first writes the step's new K/V through the slot mapping, then attends
through the block tables; a batch where every sequence has one query token takes the decode kernel.
A sequence verifying a token tree attends as decode rows, one per token, each hiding the tree's
tokens off its own path (`AttentionMetadata.tree_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pyserve import _core
from pyserve.kernels import extend_attention as extend
from pyserve.kernels import kv_cache_write as kv_write
from pyserve.kernels import paged_decode_attention as decode
from pyserve.model.length_groups import length_groups


@dataclass(slots=True)
class AttentionMetadata:
    """The step's paged layout, on the model's device. Built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, width]
    seq_lens: torch.Tensor  # int32 [num_seqs], context length after this step
    seq_lens_host: np.ndarray  # the same, on the host
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    query_start_loc_host: np.ndarray  # the same, on the host
    all_decode: bool
    slots_valid: bool = True  # no negative (padding) slot in slot_mapping
    # Where a sequence verifies a token tree: per token, the keys of its last 64 it hides
    # (uint64, bit b for key seq_len - 1 - b; see tree_masks), and per sequence whether it is a
    # tree. None: no tree this step.
    tree_masks: np.ndarray | None = None
    tree_seqs: np.ndarray | None = None
    torch_plan: TorchPlan | None = None  # the torch backend's per-step layout, built by its first layer
    triton_plan: TritonPlan | None = None  # the triton backend's, for a step that is not all decode

    @classmethod
    def build(
        cls,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        device: torch.device,
        tree_parents: np.ndarray | None = None,
        masks: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """`tree_parents`: the scheduler's (per token, the row of its request's tokens it
        follows, -1 for the first; empty or None without a tree); or, for a step of one-token
        queries, their `masks` (uint64, as tree_masks gives them)."""
        query_lens = np.diff(query_start_loc)
        seqs = None
        if tree_parents is not None and len(tree_parents):
            masks, seqs = tree_masks(tree_parents, query_start_loc)
        elif masks is not None and not (query_lens == 1).all():
            raise ValueError("AttentionMetadata.build: masks are for steps of one-token queries")

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        return cls(
            slots_valid=bool((slot_mapping >= 0).all()),
            slot_mapping=dev(slot_mapping),
            block_tables=dev(block_tables),
            seq_lens=dev(seq_lens),
            seq_lens_host=seq_lens,
            query_start_loc=dev(query_start_loc),
            query_start_loc_host=query_start_loc,
            all_decode=bool((query_lens == 1).all()),
            tree_masks=masks,
            tree_seqs=seqs,
        )


def tree_masks(tree_parents: np.ndarray, query_start_loc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 per token: the keys among its last 64 a token sees, bit b for the key b rows back;
    bool per sequence: its tokens are not a chain). A token sees every key before its sequence's
    first row of the step and its chain of parents: its mask is its parent's shifted by the rows
    between them, plus itself (a chain's rows see everything)."""
    masks = np.full(len(tree_parents), np.uint64(2**64 - 1), dtype=np.uint64)
    rows = np.arange(len(tree_parents)) - np.repeat(query_start_loc[:-1], np.diff(query_start_loc))
    off_chain = tree_parents != rows - 1
    seqs = np.zeros(len(query_start_loc) - 1, dtype=bool)
    for seq in np.unique(np.searchsorted(query_start_loc, np.flatnonzero(off_chain), side="right") - 1):
        seqs[seq] = True
        first = int(query_start_loc[seq])
        for j, parent in enumerate(tree_parents[first : int(query_start_loc[seq + 1])].tolist()):
            if parent >= 0:
                masks[first + j] = (int(masks[first + parent]) << (j - parent) | 1) & (2**64 - 1)
    return masks, seqs


class AttentionBackend:
    """Writes new K/V into the cache and attends through the block tables."""

    name = "base"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        raise NotImplementedError

    def in_place_rows(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> InPlaceDecode | None:
        """The per-row layout when the CPU kernel attends every row of the step in place and no
        slot is padding (a whole layer can then run in one kernel call), else None."""
        return None


# A decode layout per group of sequences of similar length: (rows of the group, None for all
# rows in order; decode_layout of the group).
DecodeGroups = list[tuple[torch.Tensor | None, decode.DecodeLayout]]


@dataclass(slots=True)
class InPlaceDecode:
    """Query rows for the CPU kernel (fp32 caches on the CPU), each attended as a one-token decode
    over its own prefix: row r has block table `block_tables[r]` and `seq_lens[r]` keys. A short
    query (up to extend.SHORT_QUERY tokens: a verification of drafts, a chunk's tail) is causal
    row by row, its j-th token seeing seq_len - q_len + j + 1 keys."""

    block_tables: np.ndarray  # int32 [rows, width], C-contiguous
    seq_lens: np.ndarray  # int32 [rows]
    masks: np.ndarray | None = None  # uint64 [rows]: keys each row hides (a token tree's rows)


@dataclass(slots=True)
class TorchPlan:
    """What the CPU path derives from the step's layout alone (pages to gather, masks, the CPU
    kernel's host arrays), built once per step instead of once per layer. `decode_tokens` and
    `extend_tokens` are the rows of q each part covers (None: all of them, in order)."""

    keep: torch.Tensor | None  # rows whose slot is real (None: all)
    decode: InPlaceDecode | DecodeGroups | None
    decode_tokens: torch.Tensor | None
    extend: extend.ExtendLayout | None
    extend_tokens: torch.Tensor | None

    @classmethod
    def build(cls, meta: AttentionMetadata, k_cache: torch.Tensor, cpu_kernel: bool) -> TorchPlan:
        keep = None if meta.slots_valid else meta.slot_mapping >= 0
        if cpu_kernel and k_cache.device.type == "cpu" and k_cache.dtype == torch.float32:
            return cls._in_place(meta, k_cache, keep)
        if meta.all_decode:
            return cls(keep, _decode_groups(meta.block_tables, meta.seq_lens, meta.seq_lens_host, k_cache,
                                            _masks_on(meta, None)), None, None, None)
        qsl = meta.query_start_loc_host
        q_lens = np.diff(qsl)
        dec = None
        dec_tokens = None
        as_rows = (q_lens == 1) | _trees(meta)
        dec_seqs = np.flatnonzero(as_rows)
        if len(dec_seqs):
            rows, seq_of_row, row_lens = _decode_rows(meta, dec_seqs)
            masks = _masks_on(meta, rows)
            dec = _decode_groups(meta.block_tables[_on(meta, seq_of_row)], _on(meta, row_lens), row_lens, k_cache,
                                 masks)
            dec_tokens = _on(meta, rows)
        ext, ext_tokens = _extend_plan(meta, np.flatnonzero(~as_rows), k_cache.shape[1])
        return cls(keep, dec, dec_tokens, ext, ext_tokens if dec is not None else None)

    @classmethod
    def _in_place(cls, meta: AttentionMetadata, k_cache: torch.Tensor, keep) -> TorchPlan:
        """Every token of a short query through the CPU kernel; longer queries (prefill chunks)
        through the extend reference, which computes them blockwise."""
        if meta.all_decode:  # one row per sequence: its own table and length
            tables = np.ascontiguousarray(meta.block_tables.numpy(force=True))
            return cls(keep, InPlaceDecode(tables, meta.seq_lens_host.astype(np.int32, copy=False), meta.tree_masks),
                       None, None, None)
        qsl = meta.query_start_loc_host.astype(np.int64)
        q_lens = np.diff(qsl)
        short = (q_lens <= extend.SHORT_QUERY) | _trees(meta)
        rows, seq_of_row, row_lens = _decode_rows(meta, np.flatnonzero(short))
        dec = None
        if len(rows):
            masks = None if meta.tree_masks is None else meta.tree_masks[rows]
            dec = InPlaceDecode(np.ascontiguousarray(meta.block_tables.numpy(force=True)[seq_of_row]), row_lens, masks)
        if short.all():
            return cls(keep, dec, None, None, None)
        ext, ext_tokens = _extend_plan(meta, np.flatnonzero(~short), k_cache.shape[1])
        return cls(keep, dec, torch.from_numpy(rows) if dec is not None else None, ext, ext_tokens)


def _masks_on(meta: AttentionMetadata, rows: np.ndarray | None) -> torch.Tensor | None:
    """The tree masks of q rows `rows` (None: all) as int64 on the model's device, or None."""
    if meta.tree_masks is None:
        return None
    masks = meta.tree_masks if rows is None else meta.tree_masks[rows]
    return _on(meta, masks.view(np.int64))


def _trees(meta: AttentionMetadata) -> np.ndarray | bool:
    """Per sequence, whether it verifies a token tree (its rows attend as decode rows whatever
    their number)."""
    return False if meta.tree_seqs is None else meta.tree_seqs


def _decode_rows(meta: AttentionMetadata, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every token of the queries of sequences `seqs` as a one-token decode over its own causal
    prefix: (q rows int64, each row's sequence, each row's key count int32)."""
    qsl = meta.query_start_loc_host.astype(np.int64)
    q_lens = np.diff(qsl)
    rows, _ = _query_rows(qsl, seqs)
    seq_of_row = np.repeat(seqs, q_lens[seqs])
    row_lens = meta.seq_lens_host[seq_of_row] - q_lens[seq_of_row] + (rows - qsl[seq_of_row]) + 1
    return rows, seq_of_row, row_lens.astype(np.int32)


def _query_rows(qsl: np.ndarray, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The q rows of sequences `seqs` (in order), int64, and their own query_start_loc, int32."""
    n = np.diff(qsl)[seqs]
    sub_qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(n, out=sub_qsl[1:])
    rows = np.repeat(qsl[seqs].astype(np.int64) - sub_qsl[:-1], n) + np.arange(int(sub_qsl[-1]))
    return rows, sub_qsl


def _on(meta: AttentionMetadata, a: np.ndarray) -> torch.Tensor:
    return _on_device(a, meta.block_tables.device)


def _on_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device)


def _extend_plan(meta: AttentionMetadata, seqs: np.ndarray, block_size: int):
    """(extend_layout of sequences `seqs`, their q rows)."""
    rows, sub_qsl = _query_rows(meta.query_start_loc_host, seqs)
    idx = _on(meta, seqs)
    layout = extend.extend_layout(meta.block_tables[idx], _on(meta, sub_qsl), meta.seq_lens[idx], block_size)
    return layout, _on(meta, rows)


def _decode_groups(block_tables, seq_lens, seq_lens_host, k_cache, masks=None) -> DecodeGroups:
    """Decode layouts (with gather buffers every layer reuses) per group of similar lengths;
    `masks` (int64 per row or None) hide keys as decode_layout takes them."""
    block_size = k_cache.shape[1]
    groups = length_groups(seq_lens_host, 2 * k_cache.shape[2] * k_cache.shape[3])
    if groups is None:
        return [(None, decode.decode_layout(block_tables, seq_lens, block_size, k_cache, masks))]
    plan = []
    for rows in groups:
        rows = torch.from_numpy(rows).to(block_tables.device)
        plan.append((rows, decode.decode_layout(block_tables.index_select(0, rows), seq_lens.index_select(0, rows),
                                                block_size, k_cache,
                                                None if masks is None else masks.index_select(0, rows))))
    return plan


def _decode_attention(q, k_cache, v_cache, plan: InPlaceDecode | DecodeGroups, scale):
    """Decode attention: through the CPU kernel (on torch's intra-op threads), or the reference run
    per group of similar lengths (padding only to each group's longest)."""
    if isinstance(plan, InPlaceDecode):
        out = torch.empty(q.shape, dtype=q.dtype)
        _core.paged_decode_attention(q.contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), plan.block_tables,
                                     plan.seq_lens, scale, out.numpy(), threads=torch.get_num_threads(),
                                     masks=plan.masks)
        return out
    if plan[0][0] is None:
        return decode.decode_attention_with_layout(q, k_cache, v_cache, plan[0][1], scale)
    out = torch.empty_like(q)
    for rows, layout in plan:
        out.index_copy_(0, rows, decode.decode_attention_with_layout(q.index_select(0, rows), k_cache, v_cache,
                                                                     layout, scale))
    return out


class TorchBackend(AttentionBackend):
    """The CPU path. Decode rows of an fp32 cache go through pyserve's CPU kernel (Rust, in
    `pyserve._core`: pages read in place); other decode rows through the reference, in groups of
    similar length; extending rows through the reference, short queries vectorized and the rest
    per sequence. The references' argument checks and layout work run once per step (TorchPlan),
    not once per layer. `cpu_kernel=False` keeps every row on the references."""

    name = "torch"

    def __init__(self, cpu_kernel: bool = True):
        self.cpu_kernel = cpu_kernel

    def in_place_rows(self, meta, k_cache):
        plan = meta.torch_plan
        if plan is None:
            plan = meta.torch_plan = TorchPlan.build(meta, k_cache, self.cpu_kernel)
        if plan.keep is None and plan.extend is None and isinstance(plan.decode, InPlaceDecode):
            return plan.decode
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        plan = meta.torch_plan
        if plan is None:
            plan = meta.torch_plan = TorchPlan.build(meta, k_cache, self.cpu_kernel)
        kv_write.write_kv_rows(k, v, k_cache, v_cache, meta.slot_mapping, plan.keep)
        if plan.extend is None:  # every row through decode attention, in order
            return _decode_attention(q, k_cache, v_cache, plan.decode, scale)
        if plan.decode is None:  # every row extends, in order
            return extend.extend_attention_with_layout(q, k_cache, v_cache, plan.extend, scale)
        out = torch.empty_like(q)
        out[plan.decode_tokens] = _decode_attention(q[plan.decode_tokens], k_cache, v_cache, plan.decode, scale)
        out[plan.extend_tokens] = extend.extend_attention_with_layout(
            q[plan.extend_tokens], k_cache, v_cache, plan.extend, scale)
        return out


# On the Triton path a query this short (a verification of drafts, a chunk's tail) attends as one
# decode row per token, through the split-K decode kernel: the extend kernel would launch only
# (tiles x KV heads) programs for it, too few to fill a GPU at small batches.
SPLIT_K_QUERY = 8


@dataclass(slots=True)
class TritonPlan:
    """A step that is not all decode, on the Triton path, from the host's query offsets, built by
    the first layer: the rows of short queries as decode rows (each token with its sequence's
    table and its own causal length) for the split-K decode kernel, and the query tiles of the
    longer ones for the extend kernel."""

    decode_tokens: torch.Tensor | None  # int64 q rows; None: no short query
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    extend_tiles: torch.Tensor  # int32 [num_tiles, 2]
    decode_masks: torch.Tensor | None = None  # int64 per decode row: keys a tree's row hides

    @classmethod
    def build(cls, meta: AttentionMetadata, group: int) -> TritonPlan:
        """`group`: q heads per KV head (the extend kernel's tiles depend on it)."""
        qsl = meta.query_start_loc_host.astype(np.int64)
        q_lens = np.diff(qsl)
        short = (q_lens <= SPLIT_K_QUERY) | _trees(meta)
        tiles = _on(meta, extend.extend_tiles(qsl, group, np.flatnonzero(~short)))
        seqs = np.flatnonzero(short)
        if not len(seqs):
            return cls(None, None, None, tiles)
        rows, seq_of_row, row_lens = _decode_rows(meta, seqs)
        return cls(_on(meta, rows), meta.block_tables[_on(meta, seq_of_row)], _on(meta, row_lens), tiles,
                   _masks_on(meta, rows))


class TritonBackend(AttentionBackend):
    """The CUDA path: per layer one launch for the cache write, then the split-K decode kernel
    for decode rows and the tokens of short queries (every row of a decode step) and the extend
    kernel over the query tiles of the others. The decode kernel's workspace is the backend's,
    reused by every layer."""

    name = "triton"

    def __init__(self, workspace: decode.DecodeWorkspace | None = None) -> None:
        self.workspace = workspace or decode.DecodeWorkspace()

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int) -> None:
        """Launches every variant a step of this model uses (the KV write, decode with one split
        and with several, extend), on the null block with nothing written, so that no compile
        lands on a request."""
        dev, dtype = k_cache.device, k_cache.dtype
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        q = torch.zeros(2, num_q_heads, head_dim, dtype=dtype, device=dev)
        k = torch.zeros(2, num_kv_heads, head_dim, dtype=dtype, device=dev)
        tables = torch.zeros(2, 1, dtype=torch.int32, device=dev)
        lens = torch.ones(2, dtype=torch.int32, device=dev)
        kv_write.write_kv_cache(k, k, k_cache, v_cache, torch.full((2,), -1, dtype=torch.int64, device=dev))
        for splits in (1, 2):
            for masks in (None, torch.full((2,), -1, dtype=torch.int64, device=dev)):  # a tree's rows: masked
                decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, num_splits=splits,
                                              workspace=self.workspace, masks=masks)
        qsl = np.arange(3, dtype=np.int32)
        extend.extend_attention(q, k_cache, v_cache, tables, torch.from_numpy(qsl).to(dev), lens, 1.0,
                                tiles=_on_device(extend.extend_tiles(qsl, num_q_heads // num_kv_heads), dev))

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        kv_write.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.all_decode:
            return decode.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                 workspace=self.workspace, masks=_masks_on(meta, None))
        plan = meta.triton_plan
        if plan is None:
            plan = meta.triton_plan = TritonPlan.build(meta, q.shape[1] // k_cache.shape[2])
        out = extend.extend_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                      scale, tiles=plan.extend_tiles)
        if plan.decode_tokens is not None:
            out[plan.decode_tokens] = decode.paged_decode_attention(
                q[plan.decode_tokens], k_cache, v_cache, plan.decode_block_tables, plan.decode_seq_lens, scale,
                workspace=self.workspace, masks=plan.decode_masks)
        return out


def make_backend(name: str) -> AttentionBackend:
    backends = {"torch": TorchBackend, "triton": TritonBackend}
    if name not in backends:
        raise ValueError(f"attention_backend must be one of {sorted(backends)}, got {name!r}")
    return backends[name]()
