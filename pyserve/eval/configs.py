"""The configurations an eval compares, from CONFIGS.yaml:

    price_per_hour: 0.10        # USD per device-hour, for every configuration unless it sets its own
    concurrency: 4              # requests in flight per configuration
    warmup: 2                   # requests sent (and not measured) before the set runs
    configs:
      - name: target-int8       # unique; the report's row
        model: null             # a model directory (embedded:target, embedded:draft); null: the embedded target
        quantization: int8      # any `pyserve serve` engine setting by its name: quantization,
        speculative_config: {method: ngram, num_speculative_tokens: 4}   # max_num_seqs, ...
        lora: docstrings        # an adapter (embedded name or NAME=PATH) the requests use
        temperature: 0.0        # sampling: temperature, top_p, seed
        max_tokens: 16          # the output cap: no item generates more (items ask for their own)
        concise: true           # the server's concise policy (chat items; any local configuration),
        concise_instruction: "Be brief."   # with its instruction (default: the server's)
        max_prompt_tokens: 1024  # the server's prompt budget (chat items: older turns dropped; any
        prompt_policy: turns     #   local configuration), with its policy (default: turns)
        system_prompt: "..."    # chat items: a system message first
        prompt_template: "{prompt}"   # completion items: the prompt as sent
      - name: elsewhere
        url: http://127.0.0.1:8000/v1   # any OpenAI-compatible server, already running
        served_model: some-name
        api_key_env: ELSEWHERE_KEY      # the environment variable holding its API key (never the key here)
      - name: routed            # the embedded pair (model: null), requests sent to a route:
        route: router.json      #   a router from pyserve route-train, or
        cascade: {min_logprob: -1.5}   # a cascade (small, large: served names, default the pair)
        semantic_cache: true    # the server's semantic cache on (chat items; any local configuration)
      - name: real-cascade      # a route or cascade over models of your own: `model` served as
        model: ~/large.gguf     #   `served_model`, `models` beside it (pyserve serve --model NAME=PATH)
        served_model: large
        models: {small: ~/small.gguf}
        cascade: {small: small, large: large, min_logprob: -0.3}

A configuration is started on loopback with `pyserve serve` unless it names a `url`. Paths may
start with `~`. Keys that are not listed here are refused, naming the configuration and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pyserve.prompt_budget import POLICIES

ENGINE_SETTINGS = ("quantization", "quantization_group_size", "speculative_config", "max_num_seqs",
                   "max_model_len", "max_num_batched_tokens", "num_kv_blocks", "block_size", "dtype",
                   "enable_prefix_caching", "gguf_dequantize", "seed")


class ConfigsError(ValueError):
    """A malformed CONFIGS.yaml: the message names the configuration and the key."""


class CascadeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    small: str = "pyserve-default-draft"
    large: str = "pyserve-default"
    min_logprob: float


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1)]
    model: str | None = None
    models: dict[Annotated[str, Field(min_length=1, pattern=r"^[^=]+$")], str] = Field(default_factory=dict)
    url: str | None = None
    served_model: str | None = None
    api_key_env: Annotated[str, Field(min_length=1)] | None = None
    lora: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 0.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    seed: int | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None  # the output cap over every item's own
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"
    price_per_hour: Annotated[float, Field(ge=0)] | None = None
    concurrency: Annotated[int, Field(ge=1, le=1024)] | None = None
    route: str | None = None
    cascade: CascadeConfig | None = None
    semantic_cache: bool = False
    concise: bool = False
    concise_instruction: Annotated[str, Field(min_length=1)] | None = None
    max_prompt_tokens: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    prompt_policy: Literal[POLICIES] | None = None
    engine: dict[str, Any] = Field(default_factory=dict)  # the engine settings, gathered below

    @model_validator(mode="before")
    @classmethod
    def _gather_engine_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            data["engine"] = {k: data.pop(k) for k in ENGINE_SETTINGS if k in data}
        return data

    @field_validator("model")
    @classmethod
    def _embedded(cls, v: str | None) -> str | None:
        """`embedded:target` and `embedded:draft` name the embedded family's models."""
        if v is not None and v.startswith("embedded:"):
            from pyserve.default_model import DRAFT_DIR, TARGET_DIR

            dirs = {"embedded:target": TARGET_DIR, "embedded:draft": DRAFT_DIR}
            if v not in dirs:
                raise ValueError(f"{v!r} is not one of {', '.join(dirs)}")
            return str(dirs[v])
        return None if v is None else os.path.expanduser(v)

    @field_validator("models")
    @classmethod
    def _model_paths(cls, v: dict[str, str]) -> dict[str, str]:
        return {name: os.path.expanduser(path) for name, path in v.items()}

    @field_validator("route")
    @classmethod
    def _route_path(cls, v: str | None) -> str | None:
        return None if v is None else os.path.expanduser(v)

    @field_validator("lora")
    @classmethod
    def _lora_path(cls, v: str | None) -> str | None:
        if v is None or "=" not in v:
            return v
        name, _, path = v.partition("=")
        return f"{name}={os.path.expanduser(path)}"

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, v: str) -> str:
        if "{prompt}" not in v:
            raise ValueError("must contain {prompt}")
        return v

    @model_validator(mode="after")
    def _local_or_remote(self):
        if self.url is not None and (self.model is not None or self.models or self.engine or self.lora is not None
                                     or self.decides or self.semantic_cache or self.concise
                                     or self.max_prompt_tokens is not None):
            raise ValueError("a url configuration is already running: model, models, lora, engine settings, "
                             "routes, the cache, concise and the prompt budget do not apply")
        if self.concise_instruction is not None and not self.concise:
            raise ValueError("concise_instruction: given without concise: true")
        if self.prompt_policy is not None and self.max_prompt_tokens is None:
            raise ValueError("prompt_policy: given without max_prompt_tokens")
        if self.api_key_env is not None:
            if self.url is None:
                raise ValueError("api_key_env: only a url configuration takes a key (a local server has none)")
            if not os.environ.get(self.api_key_env):
                raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is not set")
        if self.route is not None and self.cascade is not None:
            raise ValueError("give route or cascade, not both")
        if self.decides and self.lora is not None:
            raise ValueError("lora: a route or cascade chooses between models, not adapters")
        if self.url is None and self.served_model is not None and not self.decides:
            raise ValueError("served_model: a local configuration's requests go to its model as served; "
                             "served_model names it only for a route or cascade (or a url's model)")
        if self.decides and self.model is not None and self.served_model is None:
            raise ValueError("served_model: a route or cascade over your own model names it here")
        if self.decides and self.model is None and self.served_model is not None:
            raise ValueError("served_model: the embedded pair a route or cascade is served over keeps its names")
        if self.models and not self.decides:
            raise ValueError("models: only a route or cascade sends requests to the models served beside `model`")
        if self.cascade is not None and self.model is not None:
            served = {self.served_model, *self.models}
            for role in ("small", "large"):
                name = getattr(self.cascade, role)
                if name not in served:
                    raise ValueError(f"cascade: {role}: {name!r} is not a model this configuration serves "
                                     f"({', '.join(sorted(served))})")
        return self

    @property
    def decides(self) -> bool:
        """Whether requests go to a route or cascade (named `eval`) rather than one model."""
        return self.route is not None or self.cascade is not None

    def serve_flags(self) -> list[str]:
        """`pyserve serve` flags of a local configuration (its model is `model`, given apart)."""
        import json

        flags = []
        for key, value in self.engine.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):  # a switch: prefix caching is on unless turned off, the others off
                if key == "enable_prefix_caching":
                    flags += [] if value else ["--no-prefix-caching"]
                elif value:
                    flags.append(flag)
                continue
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        for name, path in self.models.items():
            flags += ["--model", f"{name}={path}"]
        if self.lora is not None:
            flags += ["--enable-lora", "--lora-modules", self.lora]
        if self.route is not None:
            flags += ["--route", f"eval={self.route}"]
        if self.cascade is not None:
            c = self.cascade
            flags += ["--cascade", f"eval={c.small},{c.large},{c.min_logprob}"]
        if self.semantic_cache:
            flags.append("--semantic-cache")
        if self.concise:
            flags.append("--concise")
        if self.concise_instruction is not None:
            flags += ["--concise-instruction", self.concise_instruction]
        if self.max_prompt_tokens is not None:
            flags += ["--max-prompt-tokens", str(self.max_prompt_tokens)]
        if self.prompt_policy is not None:
            flags += ["--prompt-policy", self.prompt_policy]
        return flags

    @property
    def api_key(self) -> str | None:
        return None if self.api_key_env is None else os.environ[self.api_key_env]

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.partition("=")[0]


class EvalPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    price_per_hour: Annotated[float, Field(ge=0)] = 0.10
    concurrency: Annotated[int, Field(ge=1, le=1024)] = 4
    warmup: Annotated[int, Field(ge=0, le=100)] = 2
    configs: Annotated[list[EvalConfig], Field(min_length=1)]

    @model_validator(mode="after")
    def _unique_names(self):
        names = [c.name for c in self.configs]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"configs: the name {dup!r} is used twice")
        return self


def load_plan(path: str | Path) -> EvalPlan:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigsError(f"{path.name}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigsError(f"{path.name}: must be a mapping with a configs list")
    try:
        return EvalPlan.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = list(err["loc"])
        where = ""
        if len(loc) >= 2 and loc[0] == "configs" and isinstance(loc[1], int):
            configs = data.get("configs") or []
            name = configs[loc[1]].get("name") if loc[1] < len(configs) and isinstance(configs[loc[1]], dict) else None
            where = f"configs[{loc[1]}]" + (f" ({name})" if name else "")
            loc = loc[2:]
        field = ".".join(str(x) for x in loc)
        message = err["msg"].removeprefix("Value error, ")
        parts = [p for p in (where, field) if p]
        raise ConfigsError(f"{path.name}: {': '.join(parts)}: {message}" if parts else f"{path.name}: {message}") from e
