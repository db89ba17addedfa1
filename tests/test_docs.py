"""The README and the docs/ pages hold together: every relative link leads to a file that exists
(and an `#anchor` into a markdown page to one of its headings), and every flag of every `pyserve`
command is named on the page that documents that command."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """`text` without its fenced blocks and inline code spans, where a link is only text."""
    text = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
    return re.sub(r"(`+).*?\1", "", text, flags=re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^ *```.*?^ *```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    targets = LINK.findall(_prose(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_pages_have_links_to_check():
    readme = _links(ROOT / "README.md")
    assert "docs/serving.md" in readme and "docs/architecture.md" in readme
    assert sum(len(_links(page)) for page in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


def test_the_anchor_rule_is_githubs():
    assert _anchor("The embedded family's eval set") == "the-embedded-familys-eval-set"
    assert _anchor("`pyserve batch`") == "pyserve-batch"
    assert _anchor("Scale-out: tensor parallelism and replicas") == "scale-out-tensor-parallelism-and-replicas"
    assert "[x](a.md)" not in _prose("`[x](a.md)`") and "[y](b.md)" in _prose("[y](b.md)")


# Where each command's flags are documented: a flag is named on one of its pages (documented
# there, or linked from there to the page of its feature).
COMMAND_PAGES = {
    "serve": ["docs/serving.md"],
    "router": ["docs/scale-out.md"],
    "batch": ["docs/batch.md", "docs/serving.md"],
    "eval": ["docs/eval.md"],
    "route-train": ["docs/decision.md"],
    "train-eagle": ["docs/speculative.md"],
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    from pyserve.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_flag_of_every_command_is_documented():
    commands = _commands()
    assert set(commands) == set(COMMAND_PAGES), "a new command needs its page in COMMAND_PAGES"
    missing = []
    for name, parser in commands.items():
        text = "\n".join((ROOT / page).read_text(encoding="utf-8") for page in COMMAND_PAGES[name])
        flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
        assert flags, name
        missing += [f"pyserve {name} {flag}" for flag in flags
                    if not re.search(re.escape(flag) + r"(?![\w-])", text)]
    assert not missing, f"flags no page documents: {missing}"
