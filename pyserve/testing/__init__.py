"""Test and benchmark support, not a public API: what tests/ and bench/ share, imported from the
installed wheel (`from pyserve.testing import build_model`), so neither puts the other on sys.path.

  tiny_models  tiny random Hugging Face models of each supported architecture, the byte-level
               BPE tokenizer and chat template they share, random PEFT LoRA adapters for them,
               copies of model directories with edited configs
  parity       greedy references by full recomputation with transformers, and the token-exact
               comparison with them that tolerates only near-ties
  metrics      a server's /metrics, scraped and parsed
  (start_server, stop_server: `pyserve serve` on a free loopback port, from pyserve.server.child_server)
  in_process   the app and its engine in the test's event loop, behind httpx's ASGI transport
  quantized_checkpoints  tiny pre-quantized checkpoints (compressed-tensors, GPTQ, AWQ) and
               their full-precision references
  quantized_reference  w8a8's arithmetic with exact int64 sums, as layers of a transformers
               model (imports torch: import the module itself)

Importing it is cheap: torch, transformers, peft, tokenizers and httpx load inside the functions
that need them. Nothing in `pyserve` imports it.
"""

from pyserve.server.child_server import start_server, stop_server
from pyserve.testing.metrics import parse_metrics, scrape_metrics
from pyserve.testing.parity import MAX_TOKENS, NEAR_TIE, assert_parity, hf_greedy, prompts
from pyserve.testing.tiny_models import (
    ARCH_CONFIGS,
    CHAT_TEMPLATE,
    CORPUS,
    LLAMA_CONFIG,
    SPECIAL,
    build_model,
    build_tokenizer,
    copy_model,
    edit_config,
    make_adapter,
)

__all__ = [
    "ARCH_CONFIGS", "CHAT_TEMPLATE", "CORPUS", "LLAMA_CONFIG", "MAX_TOKENS", "NEAR_TIE", "SPECIAL", "assert_parity",
    "build_model", "build_tokenizer", "copy_model", "edit_config", "hf_greedy", "make_adapter", "parse_metrics",
    "prompts", "scrape_metrics", "start_server", "stop_server",
]
