"""The built-in training mix of `pyserve train-eagle`: chat requests over tasks x topics with a
share over pairs of topics, function openings as completion requests, deterministic by seed;
text mode gives openings only."""

from __future__ import annotations

from pyserve.eagle_training.prompts import CODE_REQUEST, PAIR_TASKS, TASKS, TOPICS, builtin_prompts


def test_the_chat_mix_alternates_requests_and_code_with_pairs_among_the_requests():
    prompts = builtin_prompts(True, 2000, seed=0)
    assert len(prompts) == 2000
    code_head = CODE_REQUEST.split("{code}")[0]
    code = [p for p in prompts if p.startswith(code_head)]
    requests = [p for p in prompts if not p.startswith(code_head)]
    assert len(code) == len(requests) == 1000
    assert len(set(requests)) == 1000
    pair_heads = [t.split("{a}")[0] for t in PAIR_TASKS]
    pairs = [r for r in requests if r.startswith(tuple(pair_heads))]
    assert 100 <= len(pairs) <= 150  # one in eight
    topics_seen = {t for t in TOPICS if any(t in r for r in requests)}
    assert len(topics_seen) > 0.9 * len(TOPICS)
    assert len(TASKS) * len(TOPICS) > 4000
    assert builtin_prompts(True, 2000, seed=0) == prompts
    assert builtin_prompts(True, 2000, seed=1) != prompts


def test_text_mode_gives_function_openings_only():
    prompts = builtin_prompts(False, 50, seed=0)
    assert len(prompts) == 50
    code_head = CODE_REQUEST.split("{code}")[0]
    assert not any(p.startswith(code_head) for p in prompts)
    assert all(any(line.lstrip().startswith(("def ", "async def ")) for line in p.splitlines()) for p in prompts)
