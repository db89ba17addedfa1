"""Groups of decode sequences of similar length, for the torch backend's reference decode path
(caches the CPU kernel does not take: bf16/fp16, or `TorchBackend(cpu_kernel=False)`).

That path gathers every sequence's keys padded to the longest one in its call, so a
batch mixing short and long contexts spends most of its gather and attention on padding. Split
into groups of neighbouring lengths, each call pads only to its own longest; a group costs a fixed
overhead (a gather, an attention call, a scatter), so the split is chosen by a cost model.
"""

from __future__ import annotations

import numpy as np

# A call's fixed cost, in cached elements moved (about 15 us at the ~2 elements/ns measured on
# the development CPU for the gather and attention of one layer; tuned on bench/offline.py).
CALL_OVERHEAD_ELEMENTS = 2**15
MAX_GROUPS = 8


def length_groups(seq_lens: np.ndarray, elements_per_position: int) -> list[np.ndarray] | None:
    """Indices of `seq_lens` split into up to MAX_GROUPS groups of neighbouring lengths (each
    group in ascending length), or None when one call for all is cheapest. A group's cost is
    its size times its longest length times `elements_per_position`, plus the call overhead;
    candidates are the splits of the sorted lengths into k groups of equal count."""
    n = len(seq_lens)
    if n < 2 or n * int(seq_lens.max() - seq_lens.min()) * elements_per_position <= CALL_OVERHEAD_ELEMENTS:
        return None  # no split could save a call's overhead
    order = np.argsort(seq_lens, kind="stable")
    lengths = seq_lens[order].astype(np.int64)
    best_k, best_cost = 1, n * int(lengths[-1]) * elements_per_position + CALL_OVERHEAD_ELEMENTS
    for k in range(2, min(MAX_GROUPS, n) + 1):
        ends = np.arange(1, k + 1) * n // k
        sizes = np.diff(ends, prepend=0)
        cost = int((sizes * lengths[ends - 1]).sum()) * elements_per_position + k * CALL_OVERHEAD_ELEMENTS
        if cost < best_cost:
            best_k, best_cost = k, cost
    if best_k == 1:
        return None
    ends = np.arange(1, best_k + 1) * n // best_k
    return np.split(order, ends[:-1])
