"""One tensor-parallel group on torch.distributed: its collectives, with a timeout so that no
rank waits forever on a peer that died or hung (the collective raises instead)."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist


def torchrun_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when torchrun (or its environment variables) started this process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


JOIN_TIMEOUT = 120.0  # seconds for every rank to start (import torch, load its shard) and join


class TensorParallelGroup:
    def __init__(self, rank: int, size: int, device: torch.device, group):
        self.rank, self.size, self.device, self.group = rank, size, device, group
        self.comm_seconds = 0.0  # spent in this rank's collectives (waiting on peers included)

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: torch.device, timeout: float) -> TensorParallelGroup:
        """Joins (rank 0: forms) the group: gloo on CPUs, NCCL on GPUs. `init_method`:
        tcp://HOST:PORT, or env:// (torchrun's MASTER_ADDR/MASTER_PORT). Joining may take
        JOIN_TIMEOUT; each collective after it, `timeout` seconds on this rank."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT))
        group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout))
        return cls(rank, size, device, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        start = time.perf_counter()
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype on all)."""
        start = time.perf_counter()
        dist.broadcast(x, src=0, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        return x

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
