"""The Python snippets of the README and of every docs/ page run as a reader would paste them, each
in a fresh interpreter in an empty folder, on the embedded model. A snippet that needs what a test
cannot give it says so on its first line (`# needs: server ...`) and is skipped, naming it. Also
what the pages promise to name: the embedding model's served name, the CPU-only torch install,
and the test command `.ci/run` runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = re.compile(r"# needs: (.+)")


def python_snippets(page: Path) -> list[tuple[str, str]]:
    """(the section heading, the code) of each ```python fence of `page`, in order. Lines inside
    other fences are neither code nor headings."""
    snippets, heading, fence, code = [], "", None, []
    for line in page.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence, code = stripped, []
            elif line.startswith("#"):
                heading = line.lstrip("# ").strip()
        elif stripped == "```":
            if fence == "```python":
                snippets.append((heading, "\n".join(code) + "\n"))
            fence = None
        else:
            code.append(line)
    return snippets


SNIPPETS = [(page.relative_to(ROOT).as_posix(), heading, code) for page in PAGES
            for heading, code in python_snippets(page)]


def test_only_snippets_that_need_a_server_are_skipped():
    needs = [(page, heading, NEEDS.match(code).group(1)) for page, heading, code in SNIPPETS if NEEDS.match(code)]
    assert [(page, heading) for page, heading, _ in needs] == [
        ("README.md", "The server, with the openai client"),
        ("docs/batch.md", "The Batch API in the server"),
        ("docs/responses.md", "The Responses API: `/v1/responses`"),
        ("docs/responses.md", "Agents"),
    ]
    assert all(need.startswith("server") for _, _, need in needs)
    ran = {page for page, _, code in SNIPPETS if not NEEDS.match(code)}
    assert ran == {"README.md", "docs/offline.md", "docs/lora.md", "docs/structured-output.md", "docs/rust.md"}
    assert len(SNIPPETS) - len(needs) == 5


@pytest.mark.parametrize("page, heading, code", SNIPPETS,
                         ids=[f"{page}-{i}-{heading}" for i, (page, heading, _) in enumerate(SNIPPETS)])
def test_a_docs_snippet_runs(page, heading, code, tmp_path):
    need = NEEDS.match(code)
    if need:
        pytest.skip(f"needs {need.group(1)}")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the snippet of {page} under {heading!r} failed:\n{done.stderr[-3000:]}"


def test_the_docs_name_the_embedding_models_served_name():
    from pyserve.embeddings.packaged import NAME

    page = (ROOT / "docs" / "decision.md").read_text(encoding="utf-8")
    embeddings = page.split("\n## Embeddings\n", 1)[1].split("\n## ", 1)[0]
    assert f"`{NAME}` for the default" in embeddings


def test_the_install_section_says_how_to_get_torchs_cpu_build():
    install = README.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu\npip install .\n" in install


def test_the_readmes_test_command_is_what_ci_runs():
    """.ci/run runs the command on the line after its comment "# The README's test command:"; the
    README's Test section shows it in the first fence."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# The README's test command:") + 1]
    test = README.read_text().split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    assert test.split("```\n", 2)[1] == command + "\n"
