"""Batched LoRA for a mixed batch (segmented gather matmuls): every token uses the adapter in its
slot, one launch per projection whatever the number of adapters. On the Triton path the tokens
are grouped by slot on the host (`segments`), and each program multiplies a tile of up to BLOCK_T
tokens of one adapter through tl.dot: an adapter's matrices are read once per tile, not once per
token, and the rank is looped in chunks of at most 64 (no register spill at rank 256).

Layouts:
  x:           [T, in] activations (float)
  lora_a:      [S, R, in] the S device slots' A matrices, zero-padded to rank R
  lora_b:      [S, out, R] their B matrices, zero-padded
  scaling:     f32 [S] (alpha / r; 0 for a slot whose adapter does not target this projection)
  token_slots: int64 [T], the slot of each token; -1 = the base model (no delta)
shrink: xa [T, R] f32 = x @ A[slot].T;  expand: y[t] += scaling[slot] * xa[t] @ B[slot].T, in place.
Rows of tokens without a slot are left as they are (shrink writes zeros there).
"""

import numpy as np
import torch
import triton
import triton.language as tl

from pyserve import _core
from pyserve.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from pyserve.kernels._launch import launch

GATHER_LIMIT = 1 << 22  # the reference gathers per-token matrices up to this many elements
BLOCK_T = 16  # tokens of one adapter per program (tl.dot needs 16 rows; a decode step has few)


@triton.jit
def _tile_tokens(order_ptr, tiles_ptr, BLOCK_T: tl.constexpr):
    """The program's tile: its slot, its tokens (int64: a token times a stride may pass 2**31) and
    which of the BLOCK_T places hold one."""
    tile = tl.program_id(0).to(tl.int64)
    slot = tl.load(tiles_ptr + 3 * tile).to(tl.int64)
    start = tl.load(tiles_ptr + 3 * tile + 1)
    t_mask = tl.arange(0, BLOCK_T) < tl.load(tiles_ptr + 3 * tile + 2)
    tok = tl.load(order_ptr + start + tl.arange(0, BLOCK_T), mask=t_mask, other=0)
    return slot, tok, t_mask


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ranks_ptr, order_ptr, tiles_ptr, out_ptr, fan_in,
                   stride_x, stride_a_slot, stride_a_rank, stride_out,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """xa[tokens of the tile, rank chunk] = x[tokens] @ A[slot][rank chunk].T, through tl.dot;
    chunks past the slot's own rank are left at zero."""
    slot, tok, t_mask = _tile_tokens(order_ptr, tiles_ptr, BLOCK_T)
    rank = tl.load(ranks_ptr + slot)
    if tl.program_id(1) * BLOCK_R >= rank:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, fan_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=t_mask[:, None] & (k[None, :] < fan_in),
                    other=0.0)
        a = tl.load(a_ptr + slot * stride_a_slot + r[None, :] * stride_a_rank + k[:, None],
                    mask=(r[None, :] < rank) & (k[:, None] < fan_in), other=0.0)
        acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
    tl.store(out_ptr + tok[:, None] * stride_out + r[None, :], acc, mask=t_mask[:, None] & (r[None, :] < rank))


@triton.jit
def _expand_kernel(y_ptr, xa_ptr, b_ptr, scaling_ptr, ranks_ptr, order_ptr, tiles_ptr, fan_out,
                   stride_y, stride_xa, stride_b_slot, stride_b_out,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y[tokens of the tile, n chunk] += scaling[slot] * xa[tokens] @ B[slot][n chunk].T, the slot's
    own rank looped BLOCK_R at a time."""
    slot, tok, t_mask = _tile_tokens(order_ptr, tiles_ptr, BLOCK_T)
    rank = tl.load(ranks_ptr + slot)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        xa = tl.load(xa_ptr + tok[:, None] * stride_xa + r[None, :], mask=t_mask[:, None] & (r[None, :] < rank),
                     other=0.0)
        b = tl.load(b_ptr + slot * stride_b_slot + n[None, :] * stride_b_out + r[:, None],
                    mask=(n[None, :] < fan_out) & (r[:, None] < rank), other=0.0)
        acc += tl.dot(xa, b.to(tl.float32), input_precision=DOT_PRECISION)
    acc *= tl.load(scaling_ptr + slot)
    mask = t_mask[:, None] & (n[None, :] < fan_out)
    y_at = y_ptr + tok[:, None] * stride_y + n[None, :]
    y = tl.load(y_at, mask=mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def segments(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens with a slot grouped by slot: (order int64 [U], the token ids sorted by slot,
    stable; tiles int32 [n, 3] of (slot, start in order, count <= BLOCK_T)), from the host's slots."""
    slots = np.asarray(token_slots, dtype=np.int64)
    used = np.flatnonzero(slots >= 0)
    order = used[np.argsort(slots[used], kind="stable")]
    sorted_slots = slots[order]
    bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
    starts = np.concatenate([[0], bounds]) if len(order) else np.empty(0, dtype=np.int64)
    ends = np.concatenate([bounds, [len(order)]]) if len(order) else np.empty(0, dtype=np.int64)
    tiles = [(int(sorted_slots[a]), t0, min(BLOCK_T, int(b) - t0)) for a, b in zip(starts, ends)
             for t0 in range(int(a), int(b), BLOCK_T)]
    return order, np.array(tiles, dtype=np.int32).reshape(-1, 3)


def _check(x, lora_a, lora_b, scaling, token_slots, y=None):
    check_tensor("x", x, 2, FLOAT_DTYPES)
    dev = x.device
    check_tensor("lora_a", lora_a, 3, FLOAT_DTYPES, dev)
    check_tensor("lora_b", lora_b, 3, FLOAT_DTYPES, dev)
    check_tensor("scaling", scaling, 1, (torch.float32,), dev)
    check_tensor("token_slots", token_slots, 1, (torch.int64,), dev)
    check_shape("token_slots", token_slots, x.shape[:1])
    slots, rank, fan_in = lora_a.shape
    if x.shape[1] != fan_in:
        raise ValueError(f"x has {x.shape[1]} features, lora_a expects {fan_in}")
    if lora_b.shape[0] != slots or lora_b.shape[2] != rank:
        raise ValueError(f"lora_b must have shape ({slots}, out, {rank}), got {tuple(lora_b.shape)}")
    check_shape("scaling", scaling, (slots,))
    if y is not None:
        check_tensor("y", y, 2, FLOAT_DTYPES, dev)
        check_shape("y", y, (x.shape[0], lora_b.shape[1]))


def lora_shrink(x, lora_a, ranks, order, tiles):
    """Triton launcher: xa [T, R] f32 (zeros for tokens without a slot and past a slot's rank)."""
    rank, fan_in = lora_a.shape[1], lora_a.shape[2]
    out = torch.zeros((x.shape[0], rank), dtype=torch.float32, device=x.device)
    if tiles.shape[0]:
        block_r = max(16, min(64, triton.next_power_of_2(rank)))
        launch(_shrink_kernel, (tiles.shape[0], triton.cdiv(rank, block_r)), (),
               x_ptr=x, a_ptr=lora_a, ranks_ptr=ranks, order_ptr=order, tiles_ptr=tiles, out_ptr=out, fan_in=fan_in,
               stride_x=x.stride(0), stride_a_slot=lora_a.stride(0), stride_a_rank=lora_a.stride(1),
               stride_out=out.stride(0), BLOCK_T=BLOCK_T, BLOCK_R=block_r,
               BLOCK_K=max(16, min(64, triton.next_power_of_2(fan_in))),
               DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out


def lora_expand(y, xa, lora_b, scaling, ranks, order, tiles):
    """Triton launcher: y += scaling[slot] * xa @ B[slot].T per token with a slot, in place."""
    fan_out, rank = lora_b.shape[1], lora_b.shape[2]
    if tiles.shape[0]:
        block_n = max(16, min(128, triton.next_power_of_2(fan_out)))
        launch(_expand_kernel, (tiles.shape[0], triton.cdiv(fan_out, block_n)), (),
               y_ptr=y, xa_ptr=xa, b_ptr=lora_b, scaling_ptr=scaling, ranks_ptr=ranks, order_ptr=order,
               tiles_ptr=tiles, fan_out=fan_out, stride_y=y.stride(0), stride_xa=xa.stride(0),
               stride_b_slot=lora_b.stride(0), stride_b_out=lora_b.stride(1), BLOCK_T=BLOCK_T, BLOCK_N=block_n,
               BLOCK_R=max(16, min(64, triton.next_power_of_2(rank))),
               DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32")
    return y


def add_lora(y, x, lora_a, lora_b, scaling, token_slots, segmented=None, ranks=None):
    """Checked shrink + expand on CUDA: y += the LoRA delta of every token with a slot.
    `segmented`: segments(host slots) on the device; None computes them from token_slots (a
    device sync). `ranks`: int32 [S], each slot's own rank (its matrices are zero past it), so
    the kernels stop there; None: every slot at the padded rank R."""
    _check(x, lora_a, lora_b, scaling, token_slots, y)
    if ranks is None:
        ranks = torch.full((lora_a.shape[0],), lora_a.shape[1], dtype=torch.int32, device=x.device)
    check_tensor("ranks", ranks, 1, (torch.int32,), x.device)
    check_shape("ranks", ranks, lora_a.shape[:1])
    if segmented is None:
        order, tiles = segments(token_slots.cpu().numpy())
        segmented = (torch.from_numpy(order).to(x.device), torch.from_numpy(tiles).to(x.device))
    order, tiles = segmented
    return lora_expand(y, lora_shrink(x, lora_a, ranks, order, tiles), lora_b, scaling, ranks, order, tiles)


def add_lora_ref(y, x, lora_a, lora_b, scaling, token_slots):
    """Torch reference (and the CPU path for dtypes other than fp32): per-token gathered matrices
    and two batched matmuls for small batches; one matmul pair per slot in use for large ones."""
    _check(x, lora_a, lora_b, scaling, token_slots, y)
    used = token_slots >= 0
    num_tokens, (_, rank, fan_in), fan_out = x.shape[0], lora_a.shape, lora_b.shape[1]
    if num_tokens * rank * max(fan_in, fan_out) <= GATHER_LIMIT:
        idx = token_slots.clamp(min=0)
        xa = torch.bmm(lora_a[idx].float(), x.float().unsqueeze(2))          # [T, R, 1]
        delta = torch.bmm(lora_b[idx].float(), xa).squeeze(2)                 # [T, out]
        delta *= (scaling[idx] * used).unsqueeze(1)
        y += delta.to(y.dtype)
        return y
    for slot in token_slots[used].unique().tolist():
        rows = (token_slots == slot).nonzero().squeeze(1)
        delta = (x[rows].float() @ lora_a[slot].float().T) @ lora_b[slot].float().T
        y[rows] += (delta * scaling[slot]).to(y.dtype)
    return y


def add_lora_cpu(y, x, lora_a, b_scaled, token_slots):
    """The CPU serving path for fp32, same result as `add_lora_ref`: the Rust kernel
    (`pyserve._core.lora_add`), tokens grouped by slot and each adapter's B read once per four
    tokens, on the tensors' memory in place and on torch's intra-op threads. b_scaled [S, R, out] is
    each slot's B transposed and multiplied by its scaling; token_slots is the step's slot per
    token as an int64 numpy array."""
    _core.lora_add(y.numpy(), x.contiguous().numpy(), token_slots, lora_a.numpy(), b_scaled.numpy(),
                   threads=torch.get_num_threads())
    return y
