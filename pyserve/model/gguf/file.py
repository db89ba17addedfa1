"""A GGUF file opened with the `gguf` package's reader: metadata as plain values, tensors as views
of the memory-mapped file. Opening checks what pyserve can serve (the architecture, each tensor's
type), so a file it cannot serve is refused, naming the cause, before anything else loads."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from pyserve.model.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model.gguf import metadata_cache
from pyserve.model.gguf.metadata_cache import Metadata, TensorEntry

# GGUF's `general.architecture` -> the Hugging Face architecture served for it (GGUF names the
# families as pyserve does).
ARCHITECTURES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
PLAIN_TYPES = ("F32", "F16", "BF16")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # off a CPU Int4Linear in groups of 32: the file's weights as they are
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")  # Int8Linear: each row re-rounded to one scale
DEQUANTIZED_TYPES = ("Q2_K", "Q3_K")  # widened once at load


def check_architecture(architecture: Any) -> str:
    """`general.architecture` when pyserve serves it; else an UnsupportedModelError naming it."""
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF general.architecture {architecture!r} is not supported; "
                                    f"supported: {', '.join(ARCHITECTURES)}")
    return architecture


def gguf_path(path: str | Path) -> Path | None:
    """The GGUF file a model path names: the path itself when it is a `.gguf` file or a file that
    starts with GGUF's magic (an Ollama blob is named by its digest), or the one `.gguf` file of a
    directory without a config.json; None for a Hugging Face directory. Any other file is refused."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".gguf" or _starts_with_magic(path):
            return path
        raise WeightsError(f"{path} is a file but not a GGUF file (.gguf); pyserve serves a GGUF file, a model "
                           "directory (config.json and safetensors weights) or a hub id (ORG/NAME)")
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise WeightsError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}); "
                           "name the one to serve (its path, or --gguf-file)")
    return files[0] if files else None


def _starts_with_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def open_gguf(path: str | Path) -> GgufFile:
    """The file at `path`, opened once for the config, the tokenizer and the weights alike;
    reopened when the file changes."""
    path = Path(path).resolve()
    stat = path.stat()
    return _opened(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=2)
def _opened(path: Path, mtime_ns: int, size: int) -> GgufFile:
    return GgufFile(path, mtime_ns, size)


class GgufFile:
    """One GGUF file, checked on open: its metadata values (`get`) and its tensors, each a view of
    the file mapped copy-on-write (so that tensors may be used in place). Read by `gguf`'s reader
    the first time (seconds for a vocabulary of 150k tokens: see metadata_cache), from the
    metadata cache after that."""

    def __init__(self, path: str | Path, mtime_ns: int, size: int):
        self.path = Path(path)
        self._version = (size, mtime_ns)
        cached = metadata_cache.load(self.path, size, mtime_ns)
        try:
            if cached is None:
                reader = _reader(self.path)
                cached = Metadata({k: f.contents() for k, f in reader.fields.items()},
                                  [_entry(t) for t in reader.tensors])
                mapped = reader.data
                metadata_cache.store(self.path, size, mtime_ns, cached)
            else:
                mapped = np.memmap(self.path, mode="c").view(np.ndarray)  # the view keeps the map alive
        except UnsupportedModelError:
            raise
        except (ValueError, OSError, IndexError) as e:  # a truncated file or a bad magic
            raise WeightsError(f"{self.path} is not a readable GGUF file: {e}") from None
        self._fields = dict(cached.fields)
        self._unread = set(cached.long_keys)  # kept apart by the cache: read when first asked for
        self.tensors = {t.name: GgufTensor(t.type_name, t.shape, _view(mapped, t)) for t in cached.tensors}
        self.architecture = check_architecture(self.get("general.architecture"))
        served = PLAIN_TYPES + INT4_TYPES + INT8_TYPES + DEQUANTIZED_TYPES
        for name, t in self.tensors.items():
            if t.type_name not in served:
                raise UnsupportedModelError(f"GGUF tensor {name} has type {t.type_name}, which pyserve "
                                            f"does not serve; served types: {', '.join(served)}")

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool, list), or `default` when absent."""
        if key in self._unread:
            self._read_long_lists()
        return self._fields.get(key, default)

    def values(self) -> dict[str, Any]:
        """Every metadata value, by key."""
        if self._unread:
            self._read_long_lists()
        return dict(self._fields)

    def _read_long_lists(self) -> None:
        """The values the metadata cache keeps in its entry's second file; from the file itself
        where that cannot be read."""
        keys = tuple(self._unread)
        found = metadata_cache.load_long(self.path, *self._version)
        if found is None or not set(keys) <= found.keys():
            reader = _reader(self.path)
            found = {k: reader.fields[k].contents() for k in keys}
        self._fields.update({k: found[k] for k in keys})
        self._unread.difference_update(keys)

    def arch(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`, e.g. arch("block_count")."""
        return self.get(f"{self.architecture}.{key}", default)

    @property
    def head_from_quantized_embedding(self) -> bool:
        """No `output.weight` (the head is the embedding) and the embedding in blocks: it is widened
        for its lookups, and the head served from the same blocks as a layer of its own."""
        return "output.weight" not in self.tensors and self.type_of("token_embd.weight") not in PLAIN_TYPES

    def type_of(self, name: str) -> str:
        return self.tensors[name].type_name

    def rows(self, name: str) -> int:
        """A tensor's rows (its outputs, for a matrix): GGUF lists dimensions innermost first."""
        shape = self.tensors[name].shape
        return int(shape[-1]) if len(shape) > 1 else 1

    def data(self, name: str) -> np.ndarray:
        """The tensor's stored data, a view of the mapped file: float values [rows, cols] for
        plain types (BF16 as int16 bits), raw blocks [rows, bytes per row] (uint8) otherwise."""
        t = self.tensors[name]
        data = t.data
        if t.type_name == "BF16":
            data = data.view(np.int16)
        return data


@dataclass(frozen=True)
class GgufTensor:
    type_name: str
    shape: tuple[int, ...]  # GGUF's order, innermost first
    data: np.ndarray


def _entry(t) -> TensorEntry:
    """A reader's tensor as the cache keeps it."""
    return TensorEntry(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), t.data.dtype.str,
                       tuple(t.data.shape), int(t.data_offset))


def _view(mapped: np.ndarray, t: TensorEntry) -> np.ndarray:
    """The tensor's data as the reader gave it: a view of the mapped file."""
    dtype = np.dtype(t.dtype)
    count = int(np.prod(t.data_shape))
    if t.offset + count * dtype.itemsize > mapped.nbytes:
        raise WeightsError(f"GGUF tensor {t.name} runs past the end of the file")
    return mapped[t.offset:t.offset + count * dtype.itemsize].view(dtype).reshape(t.data_shape)


def _reader(path: Path):
    """llama.cpp's GGUFReader over the file mapped copy-on-write (tensors may be used in place),
    slicing the map as a plain ndarray: it slices it at least once per metadata value (~250k
    times for a 49k-token vocabulary and its merges), and a numpy.memmap's slice costs ~3x a plain
    array's (SmolLM2's metadata: 2.8 s through the memmap, 1.3 s through the plain view).
    An architecture pyserve does not serve is refused as soon as its value is read: files write it
    first, before the vocabulary, whose parse takes most of a first open."""
    from gguf import GGUFReader  # imported here, where a GGUF is opened

    class PlainViewReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._plain = mapped.view(np.ndarray)  # the view keeps the map alive

        def _push_field(self, field, skip_sum: bool = False) -> int:
            if field.name == "general.architecture":
                check_architecture(field.contents())
            return super()._push_field(field, skip_sum)

    return PlainViewReader(str(path), "c")
