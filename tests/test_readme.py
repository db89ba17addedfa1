"""The README's Python snippets run as a reader would paste them, each in a fresh interpreter in an
empty folder, on the embedded model. A snippet that needs what a test cannot give it says so on its
first line (`# needs: server ...`) and is skipped, naming it. Also what the README promises to
name: the embedding model's served name, and the CPU-only torch install."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS = re.compile(r"# needs: (.+)")


def python_snippets() -> list[tuple[str, str]]:
    """(the section heading, the code) of each ```python fence, in order."""
    snippets, heading, code = [], "", None
    for line in README.read_text().splitlines():
        if code is None and line.startswith("#"):
            heading = line.lstrip("# ").strip()
        elif code is None and line.strip() == "```python":
            code = []
        elif code is not None and line.strip() == "```":
            snippets.append((heading, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return snippets


SNIPPETS = python_snippets()


def test_only_snippets_that_need_a_server_are_skipped():
    needs = [(heading, NEEDS.match(code).group(1)) for heading, code in SNIPPETS if NEEDS.match(code)]
    assert [heading for heading, _ in needs] == ["Two commands", "Serve"]
    assert all(need.startswith("server") for _, need in needs)
    assert len(SNIPPETS) - len(needs) == 4


@pytest.mark.parametrize("heading, code", SNIPPETS, ids=[f"{i}-{h}" for i, (h, _) in enumerate(SNIPPETS)])
def test_a_readme_snippet_runs(heading, code, tmp_path):
    need = NEEDS.match(code)
    if need:
        pytest.skip(f"needs {need.group(1)}")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the snippet under {heading!r} failed:\n{done.stderr[-3000:]}"


def test_the_readme_names_the_embedding_models_served_name():
    from pyserve.embeddings.packaged import NAME

    embeddings = README.read_text().split("**Embeddings.**", 1)[1].split("**Semantic cache**", 1)[0]
    assert f"`{NAME}` for the default" in embeddings


def test_the_install_section_says_how_to_get_torchs_cpu_build():
    install = README.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu\npip install .\n" in install
