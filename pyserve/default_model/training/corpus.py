"""The training text, all drawn from the Python standard library's own source.

Every document list is deterministic for a given Python installation: files are read in sorted
order and shuffled with a fixed seed. A few modules (and their test files) are held out for
validation; none of their text reaches any training set.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

HELD_OUT = ("csv.py", "fractions.py", "json", "shlex.py", "textwrap.py")
HELD_OUT_TESTS = ("test_csv.py", "test_fractions.py", "test_json", "test_shlex.py", "test_textwrap.py")
# Generated tables and bundled data read like noise, not like code.
SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "pydoc_data", "encodings", "__pycache__"}
MAX_FILE_BYTES = 200_000

EOT, SYSTEM, USER, ASSISTANT, END = "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [EOT, SYSTEM, USER, ASSISTANT, END]
# Tools (Hugging Face's `tools=`) go in a system turn; calls are Hermes-style <tool_call> blocks
# and tool results come back in a user turn. Without tools the rendering is the original one.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these functions. To call one, reply with <tool_call>\n"
    '{"name": NAME, "arguments": ARGUMENTS}\n</tool_call>\n<tools>\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ 'user' if m['role'] == 'tool' else m['role'] }}|>\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% else %}{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat(user: str, assistant: str) -> str:
    """One conversation as the chat template renders it, ended by the end-of-turn token."""
    return f"{USER}\n{user}{END}\n{ASSISTANT}\n{assistant}{END}\n"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(rel: Path, names: tuple[str, ...]) -> bool:
    return rel.parts[-1] in names or any(part in names for part in rel.parts[:-1])


def _read(path: Path) -> str | None:
    if path.stat().st_size > MAX_FILE_BYTES:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def source_files(root: Path | None = None) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """(train, held_out) library modules as (relative path, text), test packages excluded."""
    root = root or stdlib_root()
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIPPED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        text = _read(path)
        if text is None or not text.strip():
            continue
        (held if _is_held_out(rel, HELD_OUT) else train).append((rel, text))
    return train, held


def test_files(root: Path | None = None) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """(train, held_out) files of the standard library's own test suite (Lib/test)."""
    root = (root or stdlib_root()) / "test"
    train, held = [], []
    for path in sorted(root.rglob("test_*.py")):
        rel = path.relative_to(root)
        text = _read(path)
        if text is None:
            continue
        (held if _is_held_out(rel, HELD_OUT_TESTS) else train).append((rel, text))
    return train, held


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    source: str  # dedented
    docstring: str | None  # cleaned


def functions(text: str) -> list[Function]:
    """Every function and method in a module, with its dedented source and docstring."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            source = textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
            found.append(Function(node.name, source, ast.get_docstring(node, clean=True)))
    return found


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split())


def _humanize(test_name: str) -> str:
    return re.sub(r"_+", " ", test_name.removeprefix("test")).strip() or "the basic case"


def base_documents(files: list[tuple[Path, str]]) -> list[str]:
    """Whole modules, plus one chat exchange per documented function: the request is the
    docstring's summary, the answer is the function."""
    docs = [text for _, text in files]
    for _, text in files:
        for fn in functions(text):
            if fn.docstring and 20 <= len(fn.source) <= 1500:
                docs.append(chat(f"Write a Python function: {_summary(fn.docstring)}", fn.source))
    return docs


def docstring_documents(files: list[tuple[Path, str]]) -> list[str]:
    """The "docstrings" style: documentation prose only, as bare docstrings and as chat answers."""
    docs = []
    for _, text in files:
        for fn in functions(text):
            if fn.docstring and len(fn.docstring) >= 40:
                body = f'"""{fn.docstring}\n"""\n'
                docs.append(body)
                docs.append(chat(f"Write a Python function: {_summary(fn.docstring)}", body))
    return docs


def test_documents(files: list[tuple[Path, str]]) -> list[str]:
    """The "tests" style: unittest test methods only, as code and as chat answers."""
    docs = []
    for _, text in files:
        for fn in functions(text):
            if fn.name.startswith("test") and 40 <= len(fn.source) <= 1500:
                docs.append(fn.source)
                docs.append(chat(f"Write a test: {_humanize(fn.name)}", fn.source))
    return docs


def shuffled(docs: list[str], seed: int) -> list[str]:
    out = list(docs)
    random.Random(seed).shuffle(out)
    return out


def fingerprint(texts: list[str]) -> str:
    """sha256 of a document list: the card records it so an evaluation can tell whether this
    Python's standard library holds the same held-out text."""
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()

