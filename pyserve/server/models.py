"""The models one server serves, by name: each with its own engine (its own KV cache, scheduler
and step loop) and its own LoRA adapters. A request's `model` field names a model or an adapter
of one; adapter names are unique across the server. The first model is the primary: it takes
`--lora-modules` and the adapters loaded at runtime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyserve import __version__
from pyserve.lora.request import LoRARequest
from pyserve.http.errors import NotFound
from pyserve.server.lora_registry import LoraRegistry
from pyserve.server.settings import RequestPolicy

if TYPE_CHECKING:
    from pyserve.engine.async_engine import AsyncEngine
    from pyserve.model_choice.classifier import RouteClassifier


@dataclass(slots=True)
class ModelSpec:
    """What the server is told to serve under one name: an engine, or a function building one
    (called in the loading thread), and the adapters to load once it has started."""

    engine: AsyncEngine | Callable[[], AsyncEngine]
    lora_modules: dict[str, str] = field(default_factory=dict)
    download: Callable[[], object] | None = None  # fetches a hub id's files first (/health: "downloading")
    policy: dict[str, Any] = field(default_factory=dict)  # RequestPolicy fields in place of the server's flags
    check: Callable[[], object] | None = None  # reads the model's config (no torch) before the engine is built


@dataclass(slots=True)
class RouteSpec:
    """A served name whose requests go to one of two served models (server.decision)."""

    name: str
    small: str
    large: str
    classifier: RouteClassifier | None = None  # a route: the classifier decides
    min_logprob: float | None = None  # a cascade: the small model's confidence decides
    policy: dict[str, Any] = field(default_factory=dict)  # RequestPolicy keys over the answering model's

    def serving(self, model: ServedModel) -> ServedModel:
        """`model` as this route serves it: its request policy with the route's keys in place (a
        ValueError where the two make an inconsistent policy)."""
        if not self.policy:
            return model
        return dataclasses.replace(model, policy=dataclasses.replace(model.policy, **self.policy))

    @property
    def kind(self) -> str:
        return "route" if self.classifier is not None else "cascade"


@dataclass(slots=True)
class ServedModel:
    name: str
    engine: AsyncEngine
    loras: LoraRegistry
    policy: RequestPolicy = field(default_factory=RequestPolicy)
    # The responses' system_fingerprint: one per pyserve version, model directory and model
    # length (OpenAI's changes with the backend configuration that answers).
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        served = f"{__version__}\0{self.engine.model_path}\0{self.engine.max_model_len}"
        self.fingerprint = "fp_pyserve_" + hashlib.sha256(served.encode()).hexdigest()[:12]


class ModelTable:
    def __init__(self, models: list[ServedModel]):
        if not models:
            raise ValueError("a server serves at least one model")
        self._models = {m.name: m for m in models}
        if len(self._models) != len(models):
            raise ValueError(f"model names must be unique, got {[m.name for m in models]}")
        self.routes: dict[str, RouteSpec] = {}
        self.created = int(time.time())  # the models' cards' `created`: when the server loaded them
        self.elsewhere: dict[str, str] = {}  # names served by other endpoints: what they are

    @property
    def primary(self) -> ServedModel:
        return next(iter(self._models.values()))

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        """Every name a request may give: the models, their adapters, then the routes."""
        return [*self._models, *(a for m in self for a in m.loras.entries), *self.routes]

    def is_taken(self, name: str) -> bool:
        return (name in self._models or name in self.routes or name in self.elsewhere
                or any(name in m.loras.entries for m in self))

    def resolve(self, name: str | None) -> tuple[ServedModel, LoRARequest | None]:
        """The model (and adapter) a request's `model` field names (None: the primary); 404
        listing the names served otherwise."""
        if name is None:
            return self.primary, None
        if name in self.routes:  # where one model must stand for a route (/tokenize): its large one
            name = self.routes[name].large
        model = self._models.get(name)
        if model is not None:
            return model, None
        for model in self:
            lora = model.loras.get(name)
            if lora is not None:
                return model, lora
        if name in self.elsewhere:
            raise NotFound(f"model {name!r} is {self.elsewhere[name]}", param="model", code="model_not_found")
        names = ", ".join(map(repr, self.names()))
        raise NotFound(f"model {name!r} does not exist; this server serves {names}", param="model",
                       code="model_not_found")

    def cards(self) -> list[dict]:
        """/v1/models: each model, then its adapters (parent: the model)."""
        cards = []
        for m in self:
            base = {"object": "model", "created": self.created, "owned_by": "pyserve",
                    "max_model_len": m.engine.max_model_len}
            cards.append({"id": m.name, **base, "root": m.engine.model_path, "parent": None})
            cards += [{"id": a, **base, "root": e.lora.lora_path, "parent": m.name} for a, e in m.loras.entries.items()]
        for r in self.routes.values():
            large = self._models[r.large].engine
            cards.append({"id": r.name, "object": "model", "created": self.created, "owned_by": "pyserve", "root": None,
                          "parent": None, "max_model_len": large.max_model_len,
                          "pyserve_route": {"kind": r.kind, "small": r.small, "large": r.large}})
        return cards
