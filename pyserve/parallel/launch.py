"""Rank 0 starts the other ranks of its tensor-parallel group as child processes on this machine,
forms the group with them, and watches them: a rank that exits is reported (`on_failure`) and
the group is shut down, so that in-flight requests fail with 503 and /health turns 503 instead
of waiting on a collective that can never complete."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from pyserve.child_process import module_command
from pyserve.parallel.group import TensorParallelGroup, torchrun_rank

log = structlog.get_logger("pyserve.parallel")

WATCH_INTERVAL = 0.25


@dataclass(slots=True)
class RankSpec:
    """What a follower rank needs to build its shard, as rank 0 resolved it (sent as JSON)."""

    model_dir: str
    dtype: str
    block_size: int
    max_model_len: int
    seed: int
    quantization: str | None
    quantization_group_size: int
    gguf_dequantize: bool
    attention_backend: str
    max_loras: int
    max_lora_rank: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Followers:
    """Ranks 1..N-1, started and watched by rank 0."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.failed: BaseException | None = None
        self._stopping = threading.Event()
        self._listeners: list[Callable[[BaseException], None]] = []
        threading.Thread(target=self._watch, name="pyserve-tp-watch", daemon=True).start()

    @classmethod
    def start(cls, size: int, spec: RankSpec, device: torch.device,
              timeout: float) -> tuple[Followers, TensorParallelGroup]:
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs = [subprocess.Popen([*module_command("pyserve.worker.follower"), "--rank", str(rank),
                                   "--size", str(size), "--init-method", init, "--device", device.type,
                                   "--spec", json.dumps(dataclasses.asdict(spec))])
                 for rank in range(1, size)]
        followers = cls(procs)
        try:
            group = TensorParallelGroup.join(0, size, init, device, timeout)
        except BaseException:
            followers.stop()
            raise
        if structlog.is_configured():  # by the server (pyserve.logs); an offline LLM's stdout stays clean
            log.info("tensor_parallel_group_formed", size=size, backend="nccl" if device.type == "cuda" else "gloo",
                     pids=[p.pid for p in procs])
        return followers, group

    @classmethod
    def join_torchrun(cls, size: int, device: torch.device, timeout: float) -> tuple[Followers, TensorParallelGroup]:
        """Rank 0 of a group torchrun started (its environment variables say where to meet): the
        other ranks are torchrun's to supervise."""
        rank, world = torchrun_rank()
        if world != size or rank != 0:
            raise ValueError(f"tensor_parallel_size {size}: torchrun started rank {rank} of {world}; serve with "
                             f"--tensor-parallel-size {world} (rank 0 serves, the others follow)")
        return cls([]), TensorParallelGroup.join(0, size, "env://", device, timeout)

    def on_failure(self, listener: Callable[[BaseException], None]) -> None:
        self._listeners.append(listener)
        if self.failed is not None:
            listener(self.failed)

    def stop(self, timeout: float = 10.0) -> None:
        """Waits for ranks told to stop; kills those still running after `timeout` seconds."""
        self._stopping.set()
        for p in self.procs:
            try:
                p.wait(timeout=timeout if self.failed is None else 0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self, error: BaseException) -> None:
        """Shuts the group down at once (it is broken: `error` says why)."""
        if self.failed is None:
            self.failed = error
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL):
            dead = [(rank, p.returncode) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if dead and not self._stopping.is_set() and self.failed is None:
                rank, code = dead[0]
                error = RuntimeError(f"tensor-parallel rank {rank} exited with code {code}")
                log.error("tensor_parallel_rank_died", rank=rank, returncode=code)
                self.kill(error)
                for listener in self._listeners:
                    listener(error)
                return
