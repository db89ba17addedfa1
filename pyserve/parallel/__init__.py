"""Tensor parallelism on torch.distributed (gloo on CPUs, NCCL on GPUs): the model's layers split
over ranks (layers.py), rank 0's steps replayed in lockstep by the others (lockstep.py), the
group started and watched (group.py), and the follower ranks' entry point (follower.py)."""
