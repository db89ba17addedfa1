"""all-MiniLM-L6-v2 as the embedding model: pyserve's vectors against a reference computed here
with transformers from the same files (the tokenizers library with its padding to 128 turned off,
mean pooling over the tokens, unit length)."""

from __future__ import annotations

import numpy as np

from pyserve.embeddings.load import load_encoder

TEXTS = ["How do I reverse a list in Python?", "The capital of France is Paris.", "a",
         "Reversing a Python list: use reversed() or slicing with [::-1].", "Ünïcödé and emoji \U0001f600 text"]


def _reference(folder, texts) -> np.ndarray:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok.encode(text).ids])
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
            pooled = hidden.mean(dim=0)
            rows.append((pooled / pooled.norm()).numpy())
    return np.stack(rows)


def test_vectors_equal_the_transformers_reference(minilm):
    encoder = load_encoder(str(minilm))
    got = encoder.embed_ids(encoder.tokenize(TEXTS))
    want = _reference(minilm, TEXTS)
    assert got.shape == (len(TEXTS), 384)
    assert np.abs(got - want).max() <= 1e-5
    assert float(got[0] @ got[3]) > float(got[0] @ got[1])  # the paraphrase is nearer than the other topic


def test_a_long_input_is_measured_whole_without_the_tokenizers_warning(minilm, caplog):
    encoder = load_encoder(str(minilm))
    with caplog.at_level("WARNING"):
        (ids,) = encoder.tokenize(["word " * 600])
    assert len(ids) == 602 > encoder.max_input_tokens == 512  # the server refuses it, naming `input`
    assert not [r for r in caplog.records if "sequence length" in r.getMessage()]
