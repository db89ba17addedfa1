"""The eval set shipped for the embedded model family (data/embedded.jsonl), drawn only from the
standard-library modules its training held out (`corpus.HELD_OUT`: csv, fractions, json, shlex,
textwrap), so no item's text was trained on:

- next-line: a function's first lines; the first line generated after them must be the true
  next line (a regex: surrounding whitespace aside, exact).
- continuation: the same kind of prefix, and four candidate next lines (the true one and three
  lines from other held-out functions); the true one must have the highest loglikelihood.
- perplexity: a whole held-out function after its `def` line.
- line-prefix: like next-line (any held-out function, cut anywhere), scored with partial credit
  (the share of the true line the first generated line gets right before it differs): at this
  model size an exact line is rare for any model, while how far a model gets separates a
  larger one from a smaller one.
- code: small tasks with unit tests, written here (a chat request, the answer run with the tests
  in the sandbox); the embedded 4.2M model rarely passes them, larger models should.

`python -m pyserve.eval.embedded_set` rewrites the file; it depends on the Python installation's
standard library, like the model's own held-out text.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from pyserve.default_model.training import corpus

OUT = Path(__file__).with_name("data") / "embedded.jsonl"
CODE_TASKS = [
    ("add", "Write a Python function add(a, b) that returns the sum of a and b.",
     "assert add(2, 3) == 5\nassert add(-1, 1) == 0"),
    ("is_even", "Write a Python function is_even(n) that returns True when n is even.",
     "assert is_even(4)\nassert not is_even(7)"),
    ("reverse_words", "Write a Python function reverse_words(s) that returns the words of s in reverse order, "
     "joined by single spaces.", "assert reverse_words('a b c') == 'c b a'"),
    ("count_vowels", "Write a Python function count_vowels(s) that returns how many of its characters are "
     "vowels (a, e, i, o, u).", "assert count_vowels('banana') == 3\nassert count_vowels('xyz') == 0"),
]


def _candidates(held: list[tuple[Path, str]]) -> list[tuple[str, list[str]]]:
    """(module, function source lines) of held-out functions of a useful size."""
    found = []
    for rel, text in held:
        for fn in corpus.functions(text):
            lines = fn.source.splitlines()
            if 6 <= len(lines) <= 40 and all(len(line) < 100 for line in lines):
                found.append((str(rel), lines))
    return found


def build(next_line: int = 24, continuation: int = 24, perplexity: int = 8, line_prefix: int = 240,
          seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    _, held = corpus.source_files()
    fns = _candidates(held)
    rng.shuffle(fns)
    items: list[dict] = []
    pool = [line for _, lines in fns for line in lines[2:] if line.strip() and len(line.strip()) > 8]
    for i, (module, lines) in enumerate(fns[:next_line]):
        cut = rng.randrange(2, len(lines) - 1)
        while cut < len(lines) - 1 and not lines[cut].strip():
            cut += 1
        # The prompt stops before the newline: the tokenizer merges a newline with the indent after
        # it, so a prompt ending in a bare newline is one the model never saw (it answers with
        # another newline). The first generated line must be the true one.
        line = re.escape(lines[cut].strip())
        items.append({"id": f"next-line-{i}", "source": module, "prompt": "\n".join(lines[:cut]),
                      "scorer": "regex", "pattern": rf"^[ \t]*\n[ \t]*{line}[ \t]*(?:\n|$)", "max_tokens": 32})
    for i, (module, lines) in enumerate(fns[next_line: next_line + continuation]):
        cut = rng.randrange(2, len(lines) - 1)
        true = lines[cut]
        if not true.strip():
            continue
        indent = true[: len(true) - len(true.lstrip())]
        distractors = rng.sample([p for p in pool if p.strip() != true.strip()], 3)
        choices = ["\n" + line for line in [true] + [indent + d.strip() for d in distractors]]  # see next-line
        order = list(range(4))
        rng.shuffle(order)
        items.append({"id": f"continuation-{i}", "source": module, "prompt": "\n".join(lines[:cut]),
                      "scorer": "choice", "choices": [choices[j] for j in order], "answer": order.index(0)})
    start = next_line + continuation
    for i, (module, lines) in enumerate(fns[start: start + perplexity]):
        items.append({"id": f"perplexity-{i}", "source": module, "prompt": lines[0],
                      "scorer": "perplexity", "reference": "\n" + "\n".join(lines[1:]) + "\n"})
    # Every held-out function in turn (those above too, cut elsewhere), until there are enough.
    taken: set[tuple[int, int]] = set()
    for n in range(line_prefix * 4):
        f = n % len(fns)
        module, lines = fns[f]
        cut = rng.randrange(2, len(lines) - 1)
        while cut < len(lines) - 1 and not lines[cut].strip():
            cut += 1
        if (f, cut) in taken or not lines[cut].strip():
            continue
        taken.add((f, cut))
        items.append({"id": f"line-prefix-{len(taken) - 1}", "source": module, "prompt": "\n".join(lines[:cut]),
                      "scorer": "line_prefix", "reference": lines[cut].strip(), "max_tokens": 32})
        if len(taken) == line_prefix:
            break
    for name, request, tests in CODE_TASKS:
        items.append({"id": f"code-{name}", "source": "written for this set",
                      "messages": [{"role": "user", "content": request}], "scorer": "code", "tests": tests,
                      "timeout_s": 10, "max_tokens": 128})
    return items


def main() -> None:
    OUT.parent.mkdir(exist_ok=True)
    items = build()
    OUT.write_text("".join(json.dumps(item) + "\n" for item in items))
    print(f"{len(items)} items -> {OUT}")


if __name__ == "__main__":
    main()
