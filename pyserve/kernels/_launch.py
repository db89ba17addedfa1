"""How the launchers start a Triton kernel: by keyword, with the variant it compiles known.

Triton compiles a kernel once per key: its constexprs (upper-case names here) and launch options
(num_warps, num_stages), each tensor's
dtype and 16-byte alignment, and, for each integer it specialises (every one not named in the
kernel's `do_not_specialize`), whether the value is 1 and whether it is divisible by 16. So an
integer that changes from step to step (a batch size, a block table's width, a split count, a
stride that follows them) must be named in `do_not_specialize`, or serving compiles new variants
as batches change. Inside `recording()` every launch's key is collected: tests and
bench/gpu_check.py check that a sweep of batch sizes and table widths stays within a small,
fixed set. `observing(f)` shows every launch to `f` (the CUDA-graph tests compare a replay's
launches with its capture's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# Called with (kernel name, grid, runtime names, arguments) before every launch, while set.
Observer = Callable[[str, tuple[int, ...], tuple[str, ...], dict], None]
_observer: Observer | None = None


def launch(kernel, grid: tuple[int, ...], runtime: tuple[str, ...], **args) -> None:
    """`kernel[grid](**args)`; `runtime`: the kernel's `do_not_specialize` names."""
    if _observer is not None:
        _observer(kernel.__name__, grid, runtime, args)
    kernel[grid](**args)


def variant_key(runtime: tuple[str, ...], args: dict) -> tuple:
    """What Triton keys a compiled variant on, for these launch arguments."""
    key = []
    for name, value in args.items():
        if name.isupper() or name in ("num_warps", "num_stages"):
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool) and name not in runtime:
            key.append((name, "1" if value == 1 else "D" if value % 16 == 0 else "N"))
    return tuple(key)


@contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Calls `observer` before every launch inside the block."""
    global _observer
    saved, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = saved


@contextmanager
def recording() -> Iterator[dict[str, set[tuple]]]:
    """Collects the variant key of every launch inside the block, by kernel name."""
    recorded: dict[str, set[tuple]] = defaultdict(set)
    with observing(lambda name, grid, runtime, args: recorded[name].add(variant_key(runtime, args))):
        yield recorded
