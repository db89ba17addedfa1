"""Which models `pyserve serve` serves, from its flags and its models file, as one EngineConfig
and adapter list per served name (no torch here: a bad entry is refused before anything loads).

- `pyserve serve DIR` serves DIR (named by `--served-model-name` or the directory's name);
  each `--model NAME=DIR` adds one; `--models-config FILE` adds those of a YAML file:

      models:
        - name: big                  # required, unique
          model: /path/to/dir        # required
          kv_share: 2                # weight of its part of the KV budget (default 1)
          lora_modules: {sql: /adapters/sql}
          max_num_seqs: 64           # any engine flag, by its field name, overrides the command line's
          default_max_tokens: 256    # its request policy, each key in place of --default-max-tokens /
          max_tokens_limit: 1024     #   --max-tokens-limit /
          concise: true              #   --concise /
          max_prompt_tokens: 2048    #   --max-prompt-tokens /
          prompt_policy: turns       #   --prompt-policy

- with none of them, the embedded target and draft are served as `pyserve-default` and
  `pyserve-default-draft`, a large/small pair (the draft without a speculative config).

The engine flags of the command line apply to every model. The KV budget (each engine's
automatic one: 1 GiB on a CPU, `gpu_memory_fraction` of the CUDA memory free when the engine
loads) is split between the models in proportion to their `kv_share`; `--num-kv-blocks` or a
model's own `num_kv_blocks` takes precedence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyserve.default_model import DEFAULT_MODEL_NAME, DRAFT_DIR, TARGET_DIR
from pyserve.config import EngineConfig
from pyserve.server.settings import POLICY_KEYS, RequestPolicy

DRAFT_MODEL_NAME = f"{DEFAULT_MODEL_NAME}-draft"
ENTRY_KEYS = {"name", "model", "kv_share", "lora_modules", *POLICY_KEYS}
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "kv_cache_share"}


class ModelsConfigError(ValueError):
    """A bad --model or models file entry; the message names the entry and the key."""


@dataclass(slots=True)
class ModelEntry:
    name: str
    model: str
    kv_share: float = 1.0
    lora_modules: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    policy: dict[str, Any] = field(default_factory=dict)  # RequestPolicy fields in place of the server's flags


def model_flag(item: str) -> tuple[str, str]:
    """One `--model NAME=DIR`."""
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ModelsConfigError(f"--model {item!r}: use NAME=DIR")
    return name, path


def load_models_file(path: str | Path) -> list[ModelEntry]:
    import yaml

    where = f"models file {path}"
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ModelsConfigError(f"{where}: {e}") from e
    if not isinstance(data, dict) or set(data) != {"models"} or not isinstance(data["models"], list):
        raise ModelsConfigError(f"{where}: must be a mapping with one key, models: a list of entries")
    return [_entry(raw, f"{where}: models[{i}]") for i, raw in enumerate(data["models"])]


def _entry(raw: Any, where: str) -> ModelEntry:
    if not isinstance(raw, dict):
        raise ModelsConfigError(f"{where}: must be a mapping")
    unknown = sorted(set(raw) - ENTRY_KEYS - ENGINE_KEYS)
    if unknown:
        raise ModelsConfigError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(ENTRY_KEYS))} "
                                f"and the engine's flags by field name)")
    for key in ("name", "model"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ModelsConfigError(f"{where}: {key} must be a non-empty string")
    share = raw.get("kv_share", 1.0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not share > 0:
        raise ModelsConfigError(f"{where}: kv_share must be a positive number")
    loras = raw.get("lora_modules", {})
    if not isinstance(loras, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in loras.items()):
        raise ModelsConfigError(f"{where}: lora_modules must map adapter names to directories")
    policy = {k: raw[k] for k in POLICY_KEYS if k in raw}
    try:
        RequestPolicy(**policy)
    except ValueError as e:
        raise ModelsConfigError(f"{where}: {e}") from e
    return ModelEntry(raw["name"], raw["model"], float(share), dict(loras),
                      {k: v for k, v in raw.items() if k in ENGINE_KEYS}, policy)


def default_pair() -> list[ModelEntry]:
    return [ModelEntry(DEFAULT_MODEL_NAME, str(TARGET_DIR)),
            ModelEntry(DRAFT_MODEL_NAME, str(DRAFT_DIR), overrides={"speculative_config": None})]


def engine_configs(entries: list[ModelEntry], base: dict[str, Any]) -> dict[str, tuple[EngineConfig, dict[str, str]]]:
    """name -> (EngineConfig, adapters to load): `base` (the command line's engine fields) under
    each entry's overrides, with its part of the KV budget. A bad value is a ModelsConfigError
    naming the model."""
    names = [e.name for e in entries]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise ModelsConfigError(f"model {repeated!r} is given twice")
    total = sum(e.kv_share for e in entries)
    out = {}
    for e in entries:
        fields = base | e.overrides | {"model": e.model, "kv_cache_share": e.kv_share / total}
        if e.lora_modules:
            fields["enable_lora"] = True
        try:
            out[e.name] = (EngineConfig(**fields), e.lora_modules)
        except (TypeError, ValueError) as err:
            raise ModelsConfigError(f"model {e.name!r}: {err}") from err
    return out
