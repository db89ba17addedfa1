"""The cache's entries and their vector indexes: one usearch index per scope, so a lookup
searches only entries of its exact scope (another tenant's entries are not in the index it
searches). Entries expire `ttl` seconds after they are stored (a hit does not renew them); past
`max_entries` or `max_bytes` the least recently used go first. Not thread-safe: the server's
event loop owns it."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pyserve.semantic_cache.guard import Guard

SEARCH_CANDIDATES = 4  # nearest entries checked for a hit (guards may rule the nearest out)
ENTRY_OVERHEAD_BYTES = 256  # bookkeeping per entry, beside its vector and response


@dataclass(slots=True)
class Entry:
    key: int
    scope: str
    vector: np.ndarray
    guard: Guard
    response: bytes  # the answer to replay (the server's JSON of the choice's message and usage)
    tenant: str
    model: str
    stored_at: float
    threshold: float  # this entry's similarity threshold (the one calibrated when it was stored)
    hits: int = 0

    @property
    def nbytes(self) -> int:
        return self.vector.nbytes + len(self.response) + ENTRY_OVERHEAD_BYTES


@dataclass(slots=True)
class Lookup:
    entry: Entry | None
    similarity: float | None  # of the nearest entry in scope, if any
    seconds: float


class SemanticStore:
    def __init__(self, dim: int, ttl: float, max_entries: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic):
        self.dim, self.ttl, self.max_entries, self.max_bytes = dim, ttl, max_entries, max_bytes
        self._clock = clock
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._indexes: dict = {}  # scope -> usearch.index.Index
        self._keys = itertools.count(1)
        self.bytes = 0
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, scope: str, vector: np.ndarray, guard: Guard) -> Lookup:
        """The nearest live entry of `scope` at or above its threshold whose guard admits this one."""
        began = time.perf_counter()
        index = self._indexes.get(scope)
        best, nearest = None, None
        if index is not None and len(index):
            found = index.search(vector, SEARCH_CANDIDATES)
            for key, distance in zip(found.keys.tolist(), found.distances.tolist()):
                entry = self._entries.get(key)
                if entry is None:
                    continue
                if self._expired(entry):
                    self._drop(entry)
                    self.expirations += 1
                    continue
                similarity = 1.0 - distance
                nearest = similarity if nearest is None else max(nearest, similarity)
                if similarity >= entry.threshold and entry.guard.admits(guard):
                    best = entry
                    break
        if best is not None:
            best.hits += 1
            self._entries.move_to_end(best.key)
        return Lookup(best, nearest, time.perf_counter() - began)

    def insert(self, scope: str, vector: np.ndarray, guard: Guard, response: bytes, tenant: str,
               model: str, threshold: float) -> Entry:
        entry = Entry(next(self._keys), scope, vector.astype(np.float32, copy=False), guard, response, tenant,
                      model, self._clock(), threshold)
        index = self._indexes.get(scope)
        if index is None:
            from usearch.index import Index  # imported with the first entry: the server binds its socket first

            index = self._indexes[scope] = Index(ndim=self.dim, metric="ip", dtype="f32")
        index.add(entry.key, entry.vector)
        self._entries[entry.key] = entry
        self.bytes += entry.nbytes
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries.values())))
            self.evictions += 1
        return entry

    def held(self, match: Callable[[Entry], bool]) -> tuple[int, int]:
        """How many entries `match` accepts, and their bytes."""
        mine = [e.nbytes for e in self._entries.values() if match(e)]
        return len(mine), sum(mine)

    def invalidate(self, match: Callable[[Entry], bool]) -> int:
        """Drops every entry `match` accepts; returns how many."""
        doomed = [e for e in self._entries.values() if match(e)]
        for entry in doomed:
            self._drop(entry)
        return len(doomed)

    def _expired(self, entry: Entry) -> bool:
        return self._clock() - entry.stored_at >= self.ttl

    def _drop(self, entry: Entry) -> None:
        del self._entries[entry.key]
        self.bytes -= entry.nbytes
        index = self._indexes[entry.scope]
        index.remove(entry.key)
        if not len(index):
            del self._indexes[entry.scope]
