"""Device slots for LoRA adapters: the model's target projections get stacked A/B tensors with
`max_loras` slots; adapters live on the CPU once loaded and are copied into a slot when a step
needs them, evicting the least recently used adapter the step does not need. The scheduler
guarantees a step never needs more than `max_loras` adapters."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pyserve.kernels.lora import add_lora, add_lora_cpu, add_lora_ref, segments
from pyserve.lora.adapter import TARGETS, LoraAdapter
from pyserve.model.quantized_linear import QUANTIZED
from pyserve.parallel.layers import RowParallel

ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns under tensor parallelism


@dataclass(slots=True)
class LoraBatch:
    """The current step's token -> slot map, shared by every LoRA projection; None = no adapter."""

    token_slots: torch.Tensor | None = None
    slots_host: np.ndarray | None = None  # token_slots as numpy, for the fp32 CPU kernel
    segmented: tuple[torch.Tensor, torch.Tensor] | None = None  # kernels.lora.segments, for Triton


class LoraLinear(nn.Module):
    """A base projection plus the LoRA delta of each token's slot."""

    def __init__(self, base: nn.Module, num_slots: int, max_rank: int, batch: LoraBatch, use_triton: bool,
                 dtype: torch.dtype, device: torch.device):
        """`base`: an nn.Linear, or a quantized layer (a pre-quantized checkpoint's); the adapters
        are kept in the serving `dtype`."""
        super().__init__()
        self.base = base
        n, k = base.out_features, base.in_features
        self.register_buffer("lora_a", torch.zeros(num_slots, max_rank, k, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots, n, max_rank, dtype=dtype, device=device))
        self.register_buffer("scaling", torch.zeros(num_slots, dtype=torch.float32, device=device))
        self.register_buffer("ranks", torch.zeros(num_slots, dtype=torch.int32, device=device))  # 0: no delta
        self.use_triton = use_triton
        self.use_cpu_kernel = not use_triton and torch.device(device).type == "cpu" and dtype == torch.float32
        # The CPU kernel's layout: each slot's B transposed and scaled.
        b_shape = (num_slots, max_rank, n) if self.use_cpu_kernel else (0, 0, 0)
        self.register_buffer("b_scaled", torch.zeros(b_shape, dtype=dtype, device=device))
        self.batch = batch

    def slot_written(self, slot: int) -> None:
        if self.use_cpu_kernel:
            self.b_scaled[slot] = self.lora_b[slot].T * self.scaling[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.batch.token_slots
        if slots is None:
            return y
        if self.use_triton:
            return add_lora(y, x, self.lora_a, self.lora_b, self.scaling, slots, self.batch.segmented, self.ranks)
        if self.use_cpu_kernel:
            return add_lora_cpu(y, x, self.lora_a, self.b_scaled, self.batch.slots_host)
        return add_lora_ref(y, x, self.lora_a, self.lora_b, self.scaling, slots)


class LoraSlots:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, use_triton: bool,
                 shard: tuple[int, int] = (0, 1)):
        """`shard`: (rank, size) of a tensor-parallel group whose split model this is: each
        projection's adapter is split as its base is (B's rows for column-parallel projections,
        A's columns for row-parallel ones, whose partial sums the all-reduce adds up)."""
        self.num_slots = num_slots
        self.rank, self.size = shard
        self.batch = LoraBatch()
        self.layers: list[dict[str, LoraLinear]] = []
        serving = model.model.norm.weight  # the serving dtype and device
        for layer in model.model.layers:
            mods = {}
            for parent in (layer.self_attn, layer.mlp):
                for name in TARGETS:
                    owner, attr = parent, name
                    if isinstance(getattr(parent, name, None), RowParallel):  # wrap the rank's partial product
                        owner, attr = getattr(parent, name), "inner"
                    if isinstance(getattr(owner, attr, None), (nn.Linear, *QUANTIZED)):
                        wrapped = LoraLinear(getattr(owner, attr), num_slots, max_rank, self.batch, use_triton,
                                             serving.dtype, serving.device)
                        setattr(owner, attr, wrapped)
                        mods[name] = wrapped
            self.layers.append(mods)
        self.use_triton = use_triton
        self.applied: list[tuple[int, str | None]] = []  # the last prepare_step's changes: (id, path or None)
        self.adapters: dict[int, LoraAdapter] = {}  # loaded adapters (CPU), by adapter id
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident adapters, least recent first
        # Adapters queued to be added (or None: removed) by the next step, on the engine's thread,
        # so the slots never change under a running forward.
        self._changes: list[tuple[int, LoraAdapter | None]] = []

    def queue_add(self, adapter_id: int, adapter: LoraAdapter) -> None:
        self._changes.append((adapter_id, adapter))

    def queue_remove(self, adapter_id: int) -> None:
        self._changes.append((adapter_id, None))

    def prepare_step(self, adapter_ids: np.ndarray | None, num_scheduled_tokens: np.ndarray,
                     device: torch.device) -> None:
        """Applies the queued changes, then maps the step's tokens to slots: `adapter_ids` per
        scheduled request (0 = the base model), each with its `num_scheduled_tokens`."""
        self.applied = []
        while self._changes:
            adapter_id, adapter = self._changes.pop(0)
            if adapter is None:
                self.remove(adapter_id)
            else:
                self.add(adapter_id, adapter)
            self.applied.append((adapter_id, None if adapter is None else adapter.path))
        if adapter_ids is None or not adapter_ids.any():
            self.set_tokens(None, device)
            return
        slot_of = self.activate(set(adapter_ids[adapter_ids > 0].tolist()))
        req_slots = np.array([slot_of.get(a, -1) for a in adapter_ids.tolist()], dtype=np.int64)
        self.set_tokens(np.repeat(req_slots, num_scheduled_tokens), device)

    def set_tokens(self, slots: np.ndarray | None, device: torch.device) -> None:
        """The step's token -> slot map, from the host (None: no token uses an adapter)."""
        batch = self.batch
        batch.token_slots = None if slots is None else torch.from_numpy(slots).to(device)
        batch.slots_host = slots if slots is not None and torch.device(device).type == "cpu" else None
        batch.segmented = None
        if slots is not None and self.use_triton:
            order, tiles = segments(slots)
            batch.segmented = (torch.from_numpy(order).to(device), torch.from_numpy(tiles).to(device))

    def warm_up(self) -> None:
        """Launches the Triton LoRA kernels once per projection shape (one token in slot 0, its
        delta added to a scratch output), so that no compile lands on a request."""
        seen = set()
        for mod in (m for layer in self.layers for m in layer.values()):
            w = mod.lora_b  # the adapters' dtype and device (the base may be quantized: no weight to read)
            shape = (mod.base.out_features, mod.base.in_features)
            if shape in seen:
                continue
            seen.add(shape)
            x = torch.zeros(1, shape[1], dtype=w.dtype, device=w.device)
            slots = torch.zeros(1, dtype=torch.int64, device=w.device)
            add_lora(torch.zeros(1, shape[0], dtype=w.dtype, device=w.device), x, mod.lora_a, mod.lora_b,
                     mod.scaling, slots, ranks=mod.ranks)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Target module -> (in_features, out_features) of the base model (whole, not a rank's)."""
        def whole(name: str, m: LoraLinear) -> tuple[int, int]:
            k, n = m.base.in_features, m.base.out_features
            return (k * self.size, n) if name in ROW_PARALLEL else (k, n * self.size)
        return {name: whole(name, m) for name, m in self.layers[0].items()}

    def _rank_part(self, name: str, mod: LoraLinear, a: torch.Tensor, b: torch.Tensor):
        """This rank's part of an adapter's (A, B) for projection `name`."""
        if self.size == 1:
            return a, b
        if name in ROW_PARALLEL:
            k = mod.base.in_features
            return a[:, self.rank * k:(self.rank + 1) * k], b
        n = mod.base.out_features
        return a, b[self.rank * n:(self.rank + 1) * n]

    def add(self, adapter_id: int, adapter: LoraAdapter) -> None:
        self.remove(adapter_id)
        self.adapters[adapter_id] = adapter

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        self.slot_of.pop(adapter_id, None)  # the slot's contents are overwritten when reused

    def activate(self, adapter_ids: set[int]) -> dict[int, int]:
        """Puts each adapter in a slot (copying those not resident) and returns id -> slot."""
        if len(adapter_ids) > self.num_slots:
            raise RuntimeError(f"a step needs {len(adapter_ids)} adapters but there are {self.num_slots} slots")
        for aid in adapter_ids:
            if aid in self.slot_of:
                self.slot_of.move_to_end(aid)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(a for a in self.slot_of if a not in adapter_ids)
                slot = self.slot_of.pop(victim)
            self._write(slot, self.adapters[aid])
            self.slot_of[aid] = slot
        return {aid: self.slot_of[aid] for aid in adapter_ids}

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        r = adapter.rank
        for i, mods in enumerate(self.layers):
            for name, mod in mods.items():
                mod.lora_a[slot].zero_()
                mod.lora_b[slot].zero_()
                ab = adapter.weights.get((i, name))
                mod.scaling[slot] = adapter.scaling if ab is not None else 0.0
                mod.ranks[slot] = r if ab is not None else 0
                if ab is not None:
                    a, b = self._rank_part(name, mod, *ab)
                    mod.lora_a[slot, :r].copy_(a)
                    mod.lora_b[slot, :, :r].copy_(b)
                mod.slot_written(slot)
