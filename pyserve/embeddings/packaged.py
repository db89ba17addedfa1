"""The default embedding model: WordLlama's l2_supercat (256 dimensions, a static token-embedding
table over the Llama 2 tokenizer, average-pooled), which the `wordllama` wheel from PyPI holds,
so nothing is downloaded at run time.

The package's version is pinned (pyproject.toml) and the two files are checked against their
SHA-256 before use. They are read here, not through `wordllama.WordLlama.load()`: that loader
looks for the tokenizer in a folder the wheel does not have (`tokenizer/`, the wheel's is
`tokenizers/`) and then tries to download it, and importing `wordllama.inference` configures the
root logger. Pooling is the package's own rule: the mean of the tokens' rows, then unit length.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np

from pyserve.embeddings.encoder import unit_rows

PACKAGE, VERSION = "wordllama", "0.4.0.post1"
NAME = "wordllama-l2-supercat-256"
WEIGHTS = ("weights/l2_supercat_256.safetensors", "64b47a2dc493cb8e85944076601189739852d7b64e0e1eedcb1937a251cd9fd5")
TOKENIZER = ("tokenizers/l2_supercat_tokenizer_config.json",
             "93248f2a9ec36c7b35f700a033d5f36228aae48db61aee31007fa49062cdeb68")
MAX_INPUT_TOKENS = 8192


class PackagedModelError(RuntimeError):
    pass


def package_file(relative: str, sha256: str) -> Path:
    """A file of the installed wheel, checked against its pinned hash."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise PackagedModelError(f"the embedding model ships in the {PACKAGE}=={VERSION} package, which is not "
                                 f"installed (pip install {PACKAGE}=={VERSION})")
    path = Path(spec.origin).parent / relative
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise PackagedModelError(f"{path}: {e} (expected in {PACKAGE}=={VERSION})") from e
    if digest != sha256:
        raise PackagedModelError(f"{path}: SHA-256 {digest}, expected {sha256} ({PACKAGE}=={VERSION})")
    return path


class PackagedEncoder:
    name = NAME
    max_input_tokens = MAX_INPUT_TOKENS

    def __init__(self) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        weights = package_file(*WEIGHTS)
        self.table = np.ascontiguousarray(load_file(str(weights))["embedding.weight"], dtype=np.float32)
        self._tokenizer = Tokenizer.from_file(str(package_file(*TOKENIZER)))
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self.vocab_size, self.dim = self.table.shape
        self.source = str(weights)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def embed_ids(self, inputs: list[list[int]]) -> np.ndarray:
        out = np.zeros((len(inputs), self.dim), dtype=np.float32)
        for row, ids in enumerate(inputs):
            if ids:
                out[row] = self.table[ids].mean(axis=0)
        return unit_rows(out)
