"""Triton kernels, one file per family, each with its launcher and a torch reference.

This folder ships inside the wheel as `pyserve.kernels`, so the wheel claims no top-level
`kernels` import name (that name belongs to another PyPI project). The repository's top-level
`kernels/` is a symbolic link to it.

  kv_cache_write          write_kv_cache: scatter a step's new K/V rows into the paged cache by slot
  paged_decode_attention  paged_decode_attention: one query per sequence, split-K flash-decoding
  extend_attention        extend_attention: causal varlen chunks (prefill, chunked prefill, decode)
  quantized_matmul        w8a16_matmul, w4a16_matmul: weight-only quantized linears, dequantized in registers
  _checks                 the launchers' shared argument checks (ValueError naming the argument)
  _paged                  load_kv_tile, online_softmax_update: shared by both attention kernels
"""
