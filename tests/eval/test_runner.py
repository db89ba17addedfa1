"""The runner's token boundary between a context and its continuation (both tokenized together)."""

from __future__ import annotations

from pyserve.eval.runner import split_point


def test_the_continuation_starts_after_the_tokens_shared_with_the_context():
    assert split_point([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert split_point([1, 2, 3], [1, 2, 9, 5]) == 2  # the context's last token merged across the boundary
    assert split_point([1, 2, 3], [1, 2, 3]) == 2  # the continuation added no token: its last one is scored
    assert split_point([7], [8, 9]) == 1  # nothing shared: the first token still has no logprob
