"""The kernel launchers' argument checks: every refusal names the argument and what is wrong."""

from __future__ import annotations

import pytest
import torch

from pyserve.kernels._checks import FLOAT_DTYPES, check_kv_cache, check_shape, check_tensor


def test_check_tensor_names_the_argument_and_the_fault():
    with pytest.raises(TypeError, match="^x must be a torch.Tensor, got list$"):
        check_tensor("x", [1.0], 1, FLOAT_DTYPES)
    with pytest.raises(ValueError, match=r"^x must have 2 dimensions, got shape \(3,\)$"):
        check_tensor("x", torch.zeros(3), 2, FLOAT_DTYPES)
    with pytest.raises(ValueError, match=r"^x must have dtype in \(float32, float16, bfloat16\), got torch.int32$"):
        check_tensor("x", torch.zeros(3, dtype=torch.int32), 1, FLOAT_DTYPES)
    with pytest.raises(ValueError, match="^x is on cpu but the other tensors are on meta$"):
        check_tensor("x", torch.zeros(3), 1, FLOAT_DTYPES, torch.device("meta"))
    with pytest.raises(ValueError, match=r"^x must be contiguous in its last dimension, got strides \(1, 4\)$"):
        check_tensor("x", torch.zeros(4, 4).t(), 2, FLOAT_DTYPES)


def test_check_tensor_accepts_strided_rows_and_empty_tensors():
    fused = torch.zeros(5, 6, 8)
    check_tensor("q", fused[:, :4], 3, FLOAT_DTYPES)  # a view out of a fused projection: no copy needed
    check_tensor("q", torch.zeros(0, 4).t(), 2, FLOAT_DTYPES)


def test_check_shape_and_check_kv_cache_name_the_mismatch():
    with pytest.raises(ValueError, match=r"^v_cache must have shape \(2, 3\), got \(2, 4\)$"):
        check_shape("v_cache", torch.zeros(2, 4), (2, 3))
    k = torch.zeros(6, 4, 2, 8)
    check_kv_cache("q", torch.zeros(3, 4, 8), k, k.clone())
    with pytest.raises(ValueError, match="^q head_dim 16 != k_cache head_dim 8$"):
        check_kv_cache("q", torch.zeros(3, 4, 16), k, k.clone())
    with pytest.raises(ValueError, match="^q num_q_heads 3 must be a multiple of k_cache num_kv_heads 2$"):
        check_kv_cache("q", torch.zeros(3, 3, 8), k, k.clone())
    with pytest.raises(ValueError, match="^k_cache must have dtype in"):
        check_kv_cache("q", torch.zeros(3, 4, 8), k.half(), k.clone())
