"""`speculative_config` (the `LLM(...)` argument and `pyserve serve --speculative-config`),
validated once; every error names the key."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyserve.model.gguf.file import gguf_path
from pyserve.model.hub import check_hub_model, fetch_model, is_hub_id

METHODS = ("ngram", "draft_model", "eagle3")
MODEL_METHODS = ("draft_model", "eagle3")  # the methods that read `model`
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_TREE_NODES = 16
MAX_TREE_NODES = 63  # the scheduler's MAX_TREE_DRAFTS: a tree's rows hide keys through 64-bit masks


def default_speculators(model: str) -> dict[str, str]:
    """The embedded draft and EAGLE head by method when `model` is the embedded target, else none."""
    from pyserve.default_model import DRAFT_DIR, HEAD_DIR, TARGET_DIR

    if Path(model).resolve() != TARGET_DIR:
        return {}
    return {"draft_model": str(DRAFT_DIR), "eagle3": str(HEAD_DIR)}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model: the draft's directory or GGUF file; eagle3: the head's directory (a hub id: downloaded)
    model: str | None = None
    # Choose the depth per step (0 = plain decoding) from measurements; by default only where
    # the user left num_speculative_tokens out (a depth the user fixed is honoured).
    adaptive: bool = True
    # eagle3: at most this many drafts a step in a token tree (0: one chain); left out of a
    # config: DEFAULT_TREE_NODES for eagle3.
    tree_nodes: int = 0

    @classmethod
    def parse(cls, raw: dict[str, Any] | str | None, default_models: dict[str, str] | None = None,
              download: bool = True) -> SpeculativeConfig | None:
        """`raw` as given by a user (a dict, or its JSON text); `default_models` the model a
        method uses where the config names none, by method (the embedded family's draft and head).
        `download=False` (`pyserve serve`'s check before its socket): a hub id `model` is looked up
        by one request (`check_hub_model`), not fetched, and kept as given."""
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be an object with a 'method' key")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        method = raw.get("method")
        if method is None and raw.get("model") == "[ngram]":  # vLLM's spelling before its `method` key
            raise ValueError('speculative_config.method: n-gram lookup is spelled "method": "ngram" here '
                             '(not "model": "[ngram]")')
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
        defaults = {name: f.default for name, f in cls.__dataclass_fields__.items()}
        defaults["adaptive"] = "num_speculative_tokens" not in raw
        fields = {**defaults, **raw}
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = fields[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{key} must be a positive integer, got {value!r}")
        if fields["num_speculative_tokens"] > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if fields["prompt_lookup_max"] < fields["prompt_lookup_min"]:
            raise ValueError("speculative_config.prompt_lookup_max must be >= prompt_lookup_min")
        if not isinstance(fields["adaptive"], bool):
            raise ValueError("speculative_config.adaptive must be true or false")
        tree_nodes = fields["tree_nodes"]
        if "tree_nodes" not in raw:
            fields["tree_nodes"] = DEFAULT_TREE_NODES if method == "eagle3" else 0
        elif method != "eagle3":
            raise ValueError("speculative_config.tree_nodes is only for the method eagle3")
        elif not isinstance(tree_nodes, int) or isinstance(tree_nodes, bool) or not 0 <= tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"speculative_config.tree_nodes must be an integer from 0 to {MAX_TREE_NODES}, "
                             f"got {tree_nodes!r}")
        if method in MODEL_METHODS:
            model = os.path.expanduser(fields["model"]) if fields["model"] else (default_models or {}).get(method)
            if model is None:
                what = "the draft model (a directory, a GGUF file or a hub id)" if method == "draft_model" \
                    else "the EAGLE-3 head's directory"
                raise ValueError(f"speculative_config.model: {method} needs {what}")
            if is_hub_id(str(model)):  # ORG/NAME or ORG/NAME:FILE.gguf, as the target takes them
                try:
                    if not download:
                        check_hub_model(str(model), None, None)
                        return cls(**{**fields, "model": str(model)})
                    model = fetch_model(str(model), None, None)
                except ValueError as e:
                    raise ValueError(f"speculative_config.model: {e}") from None
            if method == "eagle3" and not (Path(model) / "config.json").is_file():
                raise ValueError(f"speculative_config.model: {model} is not a head directory (config.json)")
            try:
                found = (Path(model) / "config.json").is_file() or gguf_path(model) is not None
            except ValueError as e:  # a file that is no GGUF, a folder of several
                raise ValueError(f"speculative_config.model: {e}") from None
            if not found:
                raise ValueError(f"speculative_config.model: {model} is neither a model directory (config.json), "
                                 "a GGUF file nor a hub id (ORG/NAME)")
            fields["model"] = str(model)
        elif fields["model"] is not None:
            raise ValueError(f"speculative_config.model is only for the methods {list(MODEL_METHODS)}")
        return cls(**fields)
