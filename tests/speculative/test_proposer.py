"""The n-gram proposer: each request's drafts are the Rust scheduler's prompt lookup over the
request's own tokens, at the batch's depth and the proposer's n-gram bounds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pyserve import _core
from pyserve.speculative.proposer import NgramProposer, ProposalBatch


async def test_ngram_drafts_continue_the_latest_match_within_the_bounds():
    s = _core.Scheduler(num_blocks=64, block_size=4)
    s.add_request(1, [5, 6, 7, 8, 9, 5, 6], max_tokens=8)  # "5 6" occurred before: then "7 8 9"
    s.add_request(2, [1, 2, 3, 4], max_tokens=8)  # nothing repeats
    requests = [SimpleNamespace(internal_id=1), SimpleNamespace(internal_id=2)]
    batch = ProposalBatch(requests=requests, block_tables=np.zeros((2, 1), dtype=np.int32), k=2)
    assert await NgramProposer(s, min_n=1, max_n=3).propose(batch) == [[7, 8], []]
    batch.k = 3
    assert await NgramProposer(s, min_n=1, max_n=3).propose(batch) == [[7, 8, 9], []]
    assert await NgramProposer(s, min_n=3, max_n=3).propose(batch) == [[], []]  # "9 5 6" is new
