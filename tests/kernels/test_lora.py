"""The batched LoRA kernels (Triton, the torch reference and the Rust CPU kernel) against a dense
float64 computation, and the CPU kernel's argument checks and thread-count invariance.

Inputs are drawn on the CPU (seeded generators) and moved to DEVICE: the GPU where there is one
(Triton compiles for it), else the CPU under the interpreter. The float64 oracle and the Rust
kernel stay on the CPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve import _core  # noqa: E402
from pyserve.kernels import lora as lora_kernels  # noqa: E402
from pyserve.kernels.lora import add_lora, add_lora_cpu, add_lora_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def dense_delta(x, a, b, scaling, slots):
    """The float64 oracle, on the CPU whatever the inputs' device."""
    x, a, b, scaling = (t.cpu().double() for t in (x, a, b, scaling))
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] = scaling[s] * (b[s] @ (a[s] @ x[t]))
    return out


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("gather", [True, False])
def test_lora_kernels_match_reference_and_dense(gather, monkeypatch):
    g = torch.Generator().manual_seed(0)
    t, fan_in, fan_out, slots, rank = 9, 24, 40, 3, 8
    x = torch.randn(t, fan_in, generator=g)
    a = torch.randn(slots, rank, fan_in, generator=g)
    b = torch.randn(slots, fan_out, rank, generator=g)
    scaling = torch.tensor([0.5, 2.0, 0.0])
    token_slots = torch.tensor([0, -1, 1, 1, 2, 0, -1, 1, 0])
    y0 = torch.randn(t, fan_out, generator=g)
    want = y0.double() + dense_delta(x, a, b, scaling, token_slots)
    b_scaled = (b.transpose(1, 2) * scaling[:, None, None]).contiguous()
    cpu = add_lora_cpu(y0.clone(), x, a, b_scaled, token_slots.numpy())  # the Rust kernel: host memory
    torch.testing.assert_close(cpu.double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(cpu[1], y0[1])
    x, a, b, scaling, token_slots, y0 = on_device(x, a, b, scaling, token_slots, y0)
    if not gather:
        monkeypatch.setattr(lora_kernels, "GATHER_LIMIT", 0)
    ref = add_lora_ref(y0.clone(), x, a, b, scaling, token_slots)
    torch.testing.assert_close(ref.double().cpu(), want, atol=1e-4, rtol=1e-4)
    got = add_lora(y0.clone(), x, a, b, scaling, token_slots)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[1], y0[1]) and torch.equal(ref[6], y0[6])  # base tokens untouched


def test_cpu_kernel_refuses_bad_arguments_naming_them():
    x, y = np.zeros((2, 8), np.float32), np.zeros((2, 4), np.float32)
    a, b = np.zeros((3, 2, 8), np.float32), np.zeros((3, 2, 4), np.float32)
    with pytest.raises(ValueError, match="token 1: slot 5 is outside the 3 slots"):
        _core.lora_add(y, x, np.array([0, 5]), a, b)
    with pytest.raises(ValueError, match="x must be"):
        _core.lora_add(y, np.zeros((2, 9), np.float32), np.array([0, 1]), a, b)
    with pytest.raises(ValueError, match="b_scaled must be C-contiguous"):
        _core.lora_add(y, x, np.array([0, 1]), a, np.zeros((3, 4, 2), np.float32).transpose(0, 2, 1))
    assert not y.any()  # nothing written by a refused call


def test_cpu_kernel_on_torchs_threads_gives_the_bits_of_one_thread():
    # 64 tokens over 8 slots at rank 16: enough work that, with threads=2, the blocks are spread
    # over the calling thread's OpenMP team (torch's libgomp)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 96), dtype=np.float32)
    a = rng.standard_normal((8, 16, 96), dtype=np.float32)
    b = rng.standard_normal((8, 16, 200), dtype=np.float32)
    slots = np.array([-1 if t % 9 == 4 else t % 8 for t in range(64)], dtype=np.int64)
    y0 = rng.standard_normal((64, 200), dtype=np.float32)
    outs = []
    for threads in (1, 2):
        y = y0.copy()
        _core.lora_add(y, x, slots, a, b, threads=threads)
        outs.append(y)
    np.testing.assert_array_equal(outs[0], outs[1])
    want = y0.astype(np.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            want[t] += b[s].astype(np.float64).T @ (a[s].astype(np.float64) @ x[t])
    np.testing.assert_allclose(outs[1], want, rtol=1e-4, atol=1e-3)


def test_segments_group_tokens_by_slot_in_tiles_of_sixteen():
    slots = np.array([2, -1, 0, 2, 0] + [1] * 18)
    order, tiles = lora_kernels.segments(slots)
    assert order.tolist() == [2, 4, *range(5, 23), 0, 3]
    assert tiles.tolist() == [[0, 0, 2], [1, 2, 16], [1, 18, 2], [2, 20, 2]]
    order, tiles = lora_kernels.segments(np.array([-1, -1]))
    assert order.size == 0 and tiles.shape == (0, 3)


def test_the_triton_kernels_loop_the_rank_and_span_tiles():
    """Rank 80 (two rank chunks of 64), 20 tokens of one adapter (two tiles), and base tokens."""
    g = torch.Generator().manual_seed(1)
    t, fan_in, fan_out, slots, rank = 23, 20, 36, 2, 80
    x = torch.randn(t, fan_in, generator=g)
    a = torch.randn(slots, rank, fan_in, generator=g) * 0.1
    b = torch.randn(slots, fan_out, rank, generator=g) * 0.1
    scaling = torch.tensor([1.5, 0.5])
    token_slots = torch.tensor([1] * 20 + [-1, 0, 1])
    y0 = torch.randn(t, fan_out, generator=g)
    want = y0.double() + dense_delta(x, a, b, scaling, token_slots)
    order, tiles = lora_kernels.segments(token_slots.numpy())
    x, a, b, scaling, token_slots, y0, order, tiles = on_device(
        x, a, b, scaling, token_slots, y0, torch.from_numpy(order), torch.from_numpy(tiles))
    got = add_lora(y0.clone(), x, a, b, scaling, token_slots, (order, tiles))
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[20], y0[20])


def test_the_triton_kernels_stop_at_each_slots_own_rank():
    """Slot 0 has rank 5 of the padded 80: garbage past it in A and B must not count."""
    g = torch.Generator().manual_seed(2)
    t, fan_in, fan_out, rank = 6, 20, 36, 80
    a = torch.randn(2, rank, fan_in, generator=g) * 0.1
    b = torch.randn(2, fan_out, rank, generator=g) * 0.1
    clean_a, clean_b = a.clone(), b.clone()
    clean_a[0, 5:] = 0.0
    clean_b[0, :, 5:] = 0.0
    x = torch.randn(t, fan_in, generator=g)
    scaling = torch.tensor([1.0, 2.0])
    token_slots = torch.tensor([0, 1, 0, -1, 1, 0])
    y0 = torch.randn(t, fan_out, generator=g)
    want = y0.double() + dense_delta(x, clean_a, clean_b, scaling, token_slots)
    x, a, b, scaling, token_slots, y0 = on_device(x, a, b, scaling, token_slots, y0)
    got = add_lora(y0.clone(), x, a, b, scaling, token_slots,
                   ranks=torch.tensor([5, 80], dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)
