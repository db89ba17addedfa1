"""The embedded model and the prompts its constrained outputs are tried on, shared by the JSON
rule tests (json_rules, json_close)."""

from __future__ import annotations

import pytest

from pyserve import LLM


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


@pytest.fixture(scope="session")
def json_prompts() -> list[str]:
    """Prompts whose greedy constrained outputs broke the JSON rules before they held."""
    return ["Answer in JSON: ", "def parse(x):", "The user said", "import os\n", "config = ", "data:",
            "# settings\n", "{'a': 1}"]
