"""What `gguf`'s reader found in a GGUF file (its metadata values, and each tensor's type, dtype,
shape and offset), kept on disk so that a file opened before opens again without that reader: its
parse builds Python objects for every vocabulary entry and merge (2.1 s for Qwen2.5's 151k of
each, on a file read from the page cache in 0.1 s), where this cache's JSON loads in tens of ms.

An entry is named by the file's resolved path, size and modification time, so a changed file is
read again; an entry that cannot be read is ignored, one that cannot be written is skipped (the
file is then read by `gguf` every time). The folder is $PYSERVE_GGUF_CACHE, else
$XDG_CACHE_HOME/pyserve/gguf-metadata (~/.cache by default); PYSERVE_GGUF_CACHE=off turns it off.
Values that are long lists (the vocabulary, its merges, scores and types: LONG_LIST) sit in a
second file of the entry, read only when one of them is asked for: the config and the weights
need none of them (SmolLM2's entry: 1.4 KB of other values against 1.2 MB of lists).

JSON, never pickle: nothing in an entry is executed."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog

log = structlog.get_logger(__name__)
T = TypeVar("T")

VERSION = 2
LONG_LIST = 256  # a list value longer than this is kept in the entry's second file


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as the reader saw it: `shape` in GGUF's order (innermost first); its data is
    `dtype` values in `data_shape` (numpy's order) from byte `offset` of the file."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    dtype: str
    data_shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Metadata:
    """`fields`: every value as the reader gave it, or (from an entry) all but the long lists,
    whose keys are `long_keys` (their values: `load_long`)."""

    fields: dict[str, Any]
    tensors: list[TensorEntry]
    long_keys: tuple[str, ...] = ()


def folder() -> Path | None:
    configured = os.environ.get("PYSERVE_GGUF_CACHE")
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pyserve" / "gguf-metadata"


def _entry(path: Path, size: int, mtime_ns: int, part: str = "") -> Path | None:
    """The entry's file: its main one, or with `part` "long" the one of its long lists."""
    where = folder()
    if where is None:
        return None
    key = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()[:32]
    return where / (f"{key}.{part}.json" if part else f"{key}.json")


def load(path: Path, size: int, mtime_ns: int) -> Metadata | None:
    """The entry for this version of the file, or None."""
    def metadata(raw: dict[str, Any]) -> Metadata:
        tensors = [TensorEntry(t["name"], t["type"], tuple(t["shape"]), t["dtype"], tuple(t["data_shape"]),
                               t["offset"]) for t in raw["tensors"]]
        return Metadata(raw["fields"], tensors, tuple(raw["long_keys"]))

    return _read(_entry(path, size, mtime_ns), path, metadata)


def load_long(path: Path, size: int, mtime_ns: int) -> dict[str, Any] | None:
    """The long lists of the entry for this version of the file, or None."""
    return _read(_entry(path, size, mtime_ns, "long"), path, lambda raw: dict(raw["fields"]))


def _read(entry: Path | None, path: Path, build: Callable[[dict[str, Any]], T]) -> T | None:
    """`build` of an entry file's JSON; None where the file is missing, of another version or
    another file's, or unreadable (logged)."""
    if entry is None or not entry.is_file():
        return None
    try:
        raw = orjson.loads(entry.read_bytes())
        if raw.get("version") != VERSION or raw.get("file") != str(path):
            return None
        return build(raw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("gguf_metadata_cache_unreadable", entry=str(entry), error=repr(e))
        return None


def store(path: Path, size: int, mtime_ns: int, metadata: Metadata) -> None:
    """Writes the entry (whole or not at all: each file a temporary one renamed into place, the
    long lists' before the main one that names them)."""
    if _entry(path, size, mtime_ns) is None:
        return
    long = {k: v for k, v in metadata.fields.items() if isinstance(v, list) and len(v) > LONG_LIST}
    short = {k: v for k, v in metadata.fields.items() if k not in long}
    raw = {"version": VERSION, "file": str(path), "fields": short, "long_keys": list(long),
           "tensors": [{"name": t.name, "type": t.type_name, "shape": list(t.shape), "dtype": t.dtype,
                        "data_shape": list(t.data_shape), "offset": t.offset} for t in metadata.tensors]}
    long_part = {"version": VERSION, "file": str(path), "fields": long}
    if not long or _write(_entry(path, size, mtime_ns, "long"), long_part):
        _write(_entry(path, size, mtime_ns), raw)


def _write(entry: Path, raw: dict[str, Any]) -> bool:
    part = None
    try:
        data = orjson.dumps(raw)
        if orjson.loads(data)["fields"] != raw["fields"]:  # JSON has no NaN or infinity: null in their place
            log.warning("gguf_metadata_cache_not_written", entry=str(entry), error="a value JSON does not keep")
            return False
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=entry.parent, suffix=".part")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(part, entry)
        return True
    except (OSError, TypeError) as e:  # a read-only home; a value JSON cannot hold
        if part is not None:
            Path(part).unlink(missing_ok=True)
        log.warning("gguf_metadata_cache_not_written", entry=str(entry), error=repr(e))
        return False
