"""A follower rank of a tensor-parallel group: `python -m pyserve.worker.follower`, started by
rank 0 (parallel.launch) or by torchrun through `pyserve serve` on ranks other than 0. It joins
the group, builds its shard of the model and its KV cache (as many blocks as rank 0 says), then
replays rank 0's calls until told to stop."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from pyserve.config import EngineConfig
from pyserve.lora.slots import LoraSlots
from pyserve.model.attention import make_backend
from pyserve.model.checkpoint import load_config
from pyserve.model.kv_cache import allocate_kv_cache
from pyserve.model.loader import load_model
from pyserve.parallel.group import TensorParallelGroup, torchrun_rank
from pyserve.parallel.launch import RankSpec
from pyserve.parallel.layers import local_config, shard_model
from pyserve.worker.lockstep import Lockstep
from pyserve.worker.rank_setup import DTYPES, attention_backend, finish_model, rank_spec, resolve_device, resolve_dtype

# A follower waits on rank 0 for as long as the server is idle; rank 0's own timeout bounds every
# collective of a step, and rank 0 kills the group when it gives up.
IDLE_TIMEOUT = 7 * 24 * 3600.0


def _exit_with_parent() -> None:
    """Rank 0 started this process: when it is gone, so is the group."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run(rank: int, size: int, init_method: str, device: torch.device, spec: RankSpec) -> None:
    group = TensorParallelGroup.join(rank, size, init_method, device, IDLE_TIMEOUT)
    cfg = load_config(spec.model_dir)
    dtype = DTYPES[spec.dtype]
    torch.manual_seed(spec.seed)
    model = load_model(spec.model_dir, cfg, dtype, device, spec.max_model_len, spec.gguf_dequantize)
    shard_model(model, group, spec.quantization, spec.quantization_group_size)
    triton = spec.attention_backend == "triton"
    lora = LoraSlots(model, spec.max_loras, spec.max_lora_rank, triton, (rank, size)) if spec.max_loras else None
    finish_model(model, device, dtype, fuse=lora is None, quantization=spec.quantization,
                 group_size=spec.quantization_group_size)
    num_blocks = int(group.broadcast(torch.zeros(1, dtype=torch.int64, device=device)).item())
    local = local_config(cfg, size)
    kv_caches = allocate_kv_cache(local, num_blocks, spec.block_size, dtype, device)
    backend = make_backend(spec.attention_backend)
    if triton and device.type == "cuda":  # compile every kernel variant now, as rank 0 does
        backend.warm_up(*kv_caches[0], local.num_heads)
        if lora is not None:
            lora.warm_up()
    try:
        Lockstep(group, model, kv_caches, backend, lora, spec.max_lora_rank).follow()
    finally:
        group.close()


def follow_torchrun(config: EngineConfig) -> None:
    """A rank other than 0 of `pyserve serve` under torchrun: the shard `config` asks for,
    resolved as rank 0 resolves it (ModelWorker.from_config)."""
    rank, size = torchrun_rank()
    cfg = load_config(config.model)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    dtype = resolve_dtype(config.dtype, cfg, device)
    spec = rank_spec(config, config.model, cfg.served_length(config.max_model_len), dtype,
                     attention_backend(config, device))
    run(rank, size, "env://", device, spec)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m pyserve.worker.follower")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--spec", required=True, help="RankSpec as JSON")
    args = ap.parse_args()
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    device = torch.device("cuda", args.rank) if args.device == "cuda" else torch.device("cpu")
    run(args.rank, args.size, args.init_method, device, RankSpec(**json.loads(args.spec)))


if __name__ == "__main__":
    main()
