"""The server's LoRA adapters by name: the ones given at start (`--lora-modules`) and, with
`--lora-root`, the ones loaded and unloaded at runtime (the handlers are in lora_routes).

One registry per served model (server.models resolves a request's `model` field). Unloading removes the name at once
(new requests get 404) and frees the adapter's weights once its in-flight requests finish. Loads
and unloads of one name are serialized.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from pyserve.lora.request import LoRARequest
from pyserve.http.errors import BadRequest, NotFound


@dataclass(slots=True)
class _Entry:
    lora: LoRARequest
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class LoraRegistry:
    def __init__(self, engine, lora_root: str | None):
        self.engine = engine
        self.root = Path(lora_root).resolve() if lora_root else None
        self.entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)
        self._locks: dict[str, asyncio.Lock] = {}
        self._removed: dict[int, _Entry] = {}  # unloaded, weights freed once idle

    def get(self, name: str) -> LoRARequest | None:
        """The adapter served under `name`, if one is."""
        entry = self.entries.get(name)
        return None if entry is None else entry.lora

    def started(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.in_flight += 1
            entry.idle.clear()

    def finished(self, lora: LoRARequest) -> None:
        for entry in (self.entries.get(lora.lora_name), self._removed.get(lora.lora_int_id)):
            if entry is not None and entry.lora is lora:
                entry.in_flight -= 1
                if entry.in_flight == 0:
                    entry.idle.set()

    async def add(self, name: str, path: str) -> LoRARequest:
        """Loads and registers an adapter (ValueError with the reason when it is refused)."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            if name in self.entries:
                raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
            lora = LoRARequest(name, next(self._ids), path)
            await self.engine.load_lora(lora)
            entry = _Entry(lora)
            entry.idle.set()
            self.entries[name] = entry
            return lora

    async def remove(self, name: str) -> None:
        async with self._locks.setdefault(name, asyncio.Lock()):
            entry = self.entries.pop(name, None)
            if entry is None:
                raise NotFound(f"lora_name: no adapter named {name!r} is loaded", param="lora_name")
            self._removed[entry.lora.lora_int_id] = entry
            asyncio.get_running_loop().create_task(self._free_when_idle(entry))

    async def _free_when_idle(self, entry: _Entry) -> None:
        await entry.idle.wait()
        self._removed.pop(entry.lora.lora_int_id, None)
        self.engine.unload_lora(entry.lora.lora_int_id)

    def under_root(self, path: str) -> str:
        """The adapter path resolved (symlinks included), checked to lie inside the root and to be
        a path the file system can look up; a BadRequest naming lora_path otherwise."""
        assert self.root is not None
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root):
            raise BadRequest(f"lora_path must lie inside the server's LoRA root {self.root}", param="lora_path")
        try:
            target.stat()
        except FileNotFoundError:
            pass  # the loader says what is missing
        except OSError as e:  # a name or path too long, a loop of links: the path's fault, not the server's
            raise BadRequest(f"lora_path: cannot be looked up ({e.strerror})", param="lora_path") from None
        return str(target)
