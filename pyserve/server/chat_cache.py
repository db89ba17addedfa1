"""The semantic cache as /v1/chat/completions uses it (pyserve.semantic_cache holds the parts).

A request is looked up when it is deterministic (greedy by the engine's definition,
step.sampling_params.is_greedy: temperature 0 or nearly; or seeded; `--semantic-cache-sampled`
lifts that), asks for one choice, and its `Cache-Control` allows it (`no-cache`: not read, still
stored; `no-store`: neither). Its exact scope is the tenant
(server.tenants: the bearer key and the `X-Tenant` header; a batch line's, its job's owner), the
model or adapter, every field of the body but the messages, streaming and priority, and the
conversation's shape with every message that is not the user's word for word (system prompts,
assistant answers and tool calls, tool results: data, where one changed word is another state
of the world); within it, the nearest stored conversation by its user messages answers if it
passes its threshold and its guard admits the request's (semantic_cache.guard). A miss stores
the finished answer (a choice cut short by an error, a disconnect or, streamed, with tool calls
is not stored). Hits and misses say so in the `x-pyserve-cache` header and
`usage.pyserve_cache`; a streamed hit is replayed as SSE.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import orjson
from starlette.requests import Request

from pyserve.embeddings.encoder import Encoder, embed_texts
from pyserve.semantic_cache.calibration import Calibration
from pyserve.semantic_cache.guard import Guard, guard_of
from pyserve.semantic_cache.question import conversation_text, question_text
from pyserve.semantic_cache.store import Entry, Lookup, SemanticStore
from pyserve.server.completion_result import CompletionResult
from pyserve.server.schemas import ChatCompletionRequest
from pyserve.server.tenants import tenant_of
from pyserve.step.sampling_params import is_greedy

HEADER = "x-pyserve-cache"
# Left out of the exact scope: the messages (scoped apart), and what cannot change the answer
# (how it is sent, who asks, its place in the queue: a batch line's priority).
UNSCOPED_FIELDS = {"messages", "stream", "stream_options", "user", "priority"}
# Tenants whose hits, misses and stores are counted (the least recently active are forgotten):
# a client names its tenant, so their number has no bound of its own.
MAX_COUNTED_TENANTS = 10_000


@dataclass(slots=True)
class Counts:
    hits: int = 0
    misses: int = 0
    stores: int = 0


@dataclass(slots=True)
class CachePlan:
    scope: str
    tenant: str
    model: str
    vector: np.ndarray
    guard: Guard
    read: bool
    write: bool


class ChatCache:
    def __init__(self, encoder: Encoder, calibration: Calibration, ttl: float, max_entries: int, max_bytes: int,
                 sampled: bool):
        self.encoder, self.calibration, self.sampled = encoder, calibration, sampled
        self.store = SemanticStore(encoder.dim, ttl, max_entries, max_bytes)
        self.hits = self.misses = self.stores = 0
        self._tenants: OrderedDict[str, Counts] = OrderedDict()  # least recently active first

    def figures(self) -> dict:
        """The server's: entries, bytes, hits, misses, stores, evictions, expirations, the
        threshold and the bounds."""
        store = self.store
        return {"entries": len(store), "bytes": store.bytes, "hits": self.hits, "misses": self.misses,
                "stores": self.stores, "evictions": store.evictions, "expirations": store.expirations,
                **self._settings()}

    def tenant_figures(self, tenant: str) -> dict:
        """One tenant's: its entries, their bytes, its hits, misses and stores; the threshold and
        the bounds."""
        entries, nbytes = self.store.held(lambda e: e.tenant == tenant)
        counts = self._tenants.get(tenant, Counts())
        return {"entries": entries, "bytes": nbytes, "hits": counts.hits, "misses": counts.misses,
                "stores": counts.stores, **self._settings()}

    def _settings(self) -> dict:
        store = self.store
        return {"threshold": self.calibration.threshold, "ttl": store.ttl, "max_entries": store.max_entries,
                "max_bytes": store.max_bytes}

    def _counts(self, tenant: str) -> Counts:
        counts = self._tenants.pop(tenant, None) or Counts()
        self._tenants[tenant] = counts
        if len(self._tenants) > MAX_COUNTED_TENANTS:
            self._tenants.popitem(last=False)
        return counts

    def eligible(self, req: ChatCompletionRequest) -> bool:
        deterministic = (req.temperature is not None and is_greedy(req.temperature)) or req.seed is not None
        return req.n == 1 and (deterministic or self.sampled)

    async def plan(self, request: Request, req: ChatCompletionRequest, model: str) -> CachePlan | None:
        """None for a request the cache leaves alone; else its scope and embedding (a plan that
        neither reads nor writes when Cache-Control opts out: the response says "bypass")."""
        control = request.headers.get("cache-control", "").lower()
        write = "no-store" not in control
        read = write and "no-cache" not in control
        if not self.eligible(req):
            return None
        if not (read or write):
            return CachePlan("", "", model, np.zeros(0, dtype=np.float32), guard_of(""), False, False)
        # Only the user's words are matched by meaning; every other message, exactly.
        exact = [[m.role, None if m.role == "user" else _message_text(m), m.name] for m in req.messages]
        fields = req.model_dump(mode="json", exclude=UNSCOPED_FIELDS, exclude_none=True)
        tenant = tenant_of(request)
        scope = hashlib.sha256(orjson.dumps([tenant, model, exact, fields], option=orjson.OPT_SORT_KEYS)).hexdigest()
        text = conversation_text([(m.role, m.text()) for m in req.messages])
        vector = (await asyncio.to_thread(embed_texts, self.encoder, [question_text(text)]))[0]
        return CachePlan(scope, tenant, model, vector, guard_of(text), read, write)

    def lookup(self, plan: CachePlan) -> Lookup | None:
        """The store's answer (None for a plan that does not read), hits and misses counted."""
        if not plan.read:
            return None
        found = self.store.lookup(plan.scope, plan.vector, plan.guard)
        counts = self._counts(plan.tenant)
        if found.entry is None:
            self.misses += 1
            counts.misses += 1
        else:
            self.hits += 1
            counts.hits += 1
        return found

    def save(self, plan: CachePlan, result: CompletionResult) -> None:
        """Stores a finished answer: its one choice and usage."""
        choice = result.first_choice
        if not plan.write or choice.get("finish_reason") not in ("stop", "length", "tool_calls", "function_call"):
            return
        answer = orjson.dumps({"choice": choice, "usage": result.body["usage"]})
        self.store.insert(plan.scope, plan.vector, plan.guard, answer, plan.tenant, plan.model,
                          self.calibration.threshold)
        self.stores += 1
        self._counts(plan.tenant).stores += 1

    def invalidate(self, tenant: str, model: str | None) -> int:
        return self.store.invalidate(lambda e: e.tenant == tenant and (model is None or e.model == model))


def hit_body(entry: Entry, model: str, fingerprint: str) -> dict:
    """The stored answer as a new response of `model` (`fingerprint`: its system_fingerprint):
    its own id, and its tool calls' ids fresh too (a client that gets the same call twice in one
    conversation must tell the two apart)."""
    answer = orjson.loads(entry.response)
    choice = answer["choice"]
    for call in choice["message"].get("tool_calls") or []:
        call["id"] = f"call_{uuid.uuid4().hex[:24]}"
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": [choice],
            "usage": answer["usage"] | {"pyserve_cache": "hit"}}


def _message_text(m) -> str:
    """A message's text and its tool calls, less their ids (random: two runs of one conversation
    differ only there; a tool result answers the call in its place)."""
    calls = [c["function"] for c in m.for_template().get("tool_calls", [])]
    return m.text() + ("" if not calls else "\n" + orjson.dumps(calls).decode())
