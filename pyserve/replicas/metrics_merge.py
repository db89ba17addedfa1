"""The replicas' Prometheus texts as one: each sample gains a `replica` label, and each metric
family is written once (its HELP and TYPE, then its samples from every replica), as the text
format requires."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def merge_metrics(texts: dict[str, str]) -> str:
    """`texts`: replica URL -> its /metrics text. A sample is assigned to the family of the last
    HELP/TYPE line before it (histograms' _bucket/_sum/_count included)."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        label = f'replica="{_escape(replica)}"'
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(maxsplit=3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    kept = headers.setdefault(family, [])
                    if not any(h.split(maxsplit=2)[1] == parts[1] for h in kept):
                        kept.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, _, labels, value = m.groups()
            inner = f"{label},{labels}" if labels else label
            samples.setdefault(family or name, []).append(f"{name}{{{inner}}} {value}")
    out = []
    for family in dict.fromkeys([*headers, *samples]):
        out += headers.get(family, []) + samples.get(family, [])
    return "\n".join(out) + "\n" if out else ""
