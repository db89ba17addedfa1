"""HumanEval as a built-in eval set (eval/humaneval.py): the package's 164 problems as chat code
items whose canonical solutions pass in the sandbox and whose wrong answers fail
(tests/real_models/test_smollm2_humaneval.py runs `pyserve eval --data humaneval`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pyserve.eval.humaneval import humaneval_items, problems
from pyserve.eval.items import load_eval_data
from pyserve.eval.scorers import score_text

SAMPLE = slice(0, None, 8)  # 21 problems: the sandbox runs a process each


def test_the_164_problems_become_chat_code_items():
    items = load_eval_data("humaneval")
    assert len(items) == 164 and [i.id for i in items] == [f"HumanEval/{n}" for n in range(164)]
    first, p = items[0], problems()[0]
    assert first.scorer == "code" and first.preamble == p["prompt"] and first.prompt is None
    assert p["prompt"].rstrip() in first.messages[0]["content"] and first.messages[0]["role"] == "user"
    assert first.tests.rstrip().endswith(f"check({p['entry_point']})")


def _scores(answers: list[tuple]) -> list[float]:
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda ia: score_text(*ia).value, answers))


def test_canonical_solutions_pass_whether_the_answer_is_the_whole_function_or_its_body():
    items, ps = humaneval_items()[SAMPLE], problems()[SAMPLE]
    whole = [(i, f"Here it is:\n```python\n{p['prompt']}{p['canonical_solution']}```\nDone.") for i, p in zip(items, ps)]
    body = [(i, f"```python\n{p['canonical_solution']}```") for i, p in zip(items, ps)]
    assert _scores(whole) == [1.0] * len(items)
    assert _scores(body) == [1.0] * len(items)


def test_a_wrong_answer_fails():
    items, ps = humaneval_items()[SAMPLE], problems()[SAMPLE]
    wrong = [(i, f"```python\ndef {p['entry_point']}(*args, **kwargs):\n    return None\n```") for i, p in zip(items, ps)]
    assert _scores(wrong) == [0.0] * len(items)
