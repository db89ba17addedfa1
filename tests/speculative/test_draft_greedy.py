"""The draft model's greedy guesses from one `_core.greedy_decode` call equal those of its
op-by-op forwards, token for token, with the same keys and values left in its cache: for a lone
request, for requests of different depths side by side, after a catch-up longer than the call
takes (a new prompt), and on the next proposal after part of the guesses was accepted."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pyserve import _core
from pyserve.step.sampling_params import SamplingParams
from pyserve.model.attention import make_backend
from pyserve.model.config import ModelConfig
from pyserve.model.sampler import Sampler
from pyserve.model.whole_model import FEED_ROWS
from pyserve.speculative.draft_model import DraftModelProposer
from pyserve.speculative.proposer import ProposalBatch

BLOCK = 4


def proposer(model_dir, kernel: bool) -> DraftModelProposer:
    cfg = ModelConfig.from_dir(model_dir)
    p = DraftModelProposer(str(model_dir), cfg, dtype=torch.float32, device=torch.device("cpu"), num_blocks=64,
                           block_size=BLOCK, quantization=None, quantization_group_size=64, max_model_len=256,
                           backend=make_backend("torch"),
                           sampler=Sampler(cfg.vocab_size, torch.device("cpu"), seed=0))
    assert p.whole_model is not None
    if not kernel:
        p.whole_model = None  # every guess through the model's forward
    return p


def request(i: int):
    return SimpleNamespace(internal_id=i, params=SamplingParams(temperature=0.0))


def propose_both(pair, reqs, tokens, tables, k):
    batch = ProposalBatch(reqs, tables, k, [np.asarray(t, dtype=np.int64) for t in tokens])
    kernel, ops = (p.propose(batch, [None] * len(reqs)) for p in pair)
    return kernel, ops


def assert_same_cache(pair, tables, lengths):
    for r, n in enumerate(lengths):
        slots = [int(tables[r, pos // BLOCK]) * BLOCK + pos % BLOCK for pos in range(n)]
        for (k1, v1), (k2, v2) in zip(pair[0].kv_caches, pair[1].kv_caches):
            flat = [t.view(-1, *t.shape[2:]) for t in (k1, v1, k2, v2)]
            assert torch.equal(flat[0][slots], flat[2][slots]) and torch.equal(flat[1][slots], flat[3][slots])


def test_guesses_and_cache_equal_the_forward_path(llama_dir):
    vocab = ModelConfig.from_dir(llama_dir).vocab_size
    rng = np.random.default_rng(0)
    pair = (proposer(llama_dir, kernel=True), proposer(llama_dir, kernel=False))
    # Request 0: 5 prompt tokens (fed in one call); request 1: a prompt longer than one call
    # feeds (the model's forward first); request 2: room for only 2 guesses in its blocks.
    prompts = [rng.integers(1, vocab, 5).tolist(), rng.integers(1, vocab, FEED_ROWS + 7).tolist(),
               rng.integers(1, vocab, 10).tolist()]
    tables = np.zeros((3, 40), dtype=np.int32)
    tables[0, :8] = np.arange(1, 9)
    tables[1, :30] = np.arange(9, 39)
    tables[2, :3] = np.arange(39, 42)  # 12 slots: its guesses can be fed at positions 10 and 11 only
    reqs = [request(i) for i in range(3)]

    alone = propose_both(pair, reqs[:1], prompts[:1], tables[:1], 6)
    assert alone[0] == alone[1] and len(alone[0][0]) == 6
    assert_same_cache(pair, tables, [len(prompts[0]) + 5, 0, 0])

    # The first three of request 0's guesses are accepted, plus a token of the target's own.
    for p in pair:
        p.accepted(0, 3)
    prompts[0] += alone[0][0][:3] + [7]
    together = propose_both(pair, reqs, prompts, tables, 6)
    assert together[0] == together[1]
    assert [len(g) for g in together[0]] == [6, 6, 3]
    assert_same_cache(pair, tables, [len(prompts[0]) + 5, len(prompts[1]) + 5, len(prompts[2]) + 2])
    assert pair[0].num_computed == pair[1].num_computed
    assert pair[0].fed_guesses == pair[1].fed_guesses == {0: 5, 1: 5, 2: 2}


def test_bad_inputs_are_refused_naming_the_input(llama_dir):
    p = proposer(llama_dir, kernel=True)
    vocab = ModelConfig.from_dir(llama_dir).vocab_size
    tables = np.zeros((2, 4), dtype=np.int32)
    tables[:, 0] = [1, 2]

    def call(tokens, positions, depth, requests=(0,)):
        return p.whole_model.greedy(tokens, positions, requests, tables[: len(depth)], depth)

    guesses = call([3, 5], [0, 1], [3], requests=(0, 0))
    assert guesses.shape == (1, 3) and ((guesses >= 0) & (guesses < vocab)).all()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        call([vocab], [0], [1])
    with pytest.raises(ValueError, match="has no block"):
        call([3], [2], [4])  # its guesses would reach position 5, past the one block it owns
    with pytest.raises(ValueError, match="has no feed row"):
        call([3], [0], [1, 1])
    with pytest.raises(ValueError, match="depth: -1 is negative"):
        call([3], [0], [-1])
    one_layer = dataclasses.replace(p.whole_model.view, layers=p.whole_model.view.layers[:1])
    with pytest.raises(ValueError, match="caches for"):
        _core.greedy_decode(one_layer, p.whole_model.k_caches, p.whole_model.v_caches, np.array([3], np.int32),
                            np.array([0]), np.array([0]), tables[:1], np.array([1]))
