"""A GGUF file's metadata read by `gguf` once, from the cache after that (pyserve.model.gguf.metadata_cache)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyserve.model.config import UnsupportedModelError
from pyserve.model.gguf import file as gguf_file
from pyserve.model.gguf.file import GgufFile
from pyserve.testing import build_model
from pyserve.testing.tiny_gguf import LLAMA_ROPE, gguf_from_hf, gguf_rewritten


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-cache")
    return gguf_from_hf(build_model(root / "llama", "llama", **LLAMA_ROPE), root / "m.gguf", projections="Q4_0")


_REAL_READER = gguf_file._reader


def _open(path):
    stat = path.stat()
    return GgufFile(path, stat.st_mtime_ns, stat.st_size)


def _entries(folder):
    """The cache's main files (each entry's long lists sit beside it in `*.long.json`)."""
    return [p for p in folder.glob("*.json") if not p.name.endswith(".long.json")]


def _no_reader(monkeypatch):
    def refuse(path):
        raise AssertionError(f"gguf's reader opened {path}")

    monkeypatch.setattr(gguf_file, "_reader", refuse)


def test_a_file_opened_again_is_read_from_the_cache_with_the_same_values_and_tensors(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    first = _open(gguf)
    assert len(list(_entries(tmp_path / "cache"))) == 1
    _no_reader(monkeypatch)
    again = _open(gguf)
    assert again.values() == first.values() and len(again.get("tokenizer.ggml.tokens")) > 100
    assert list(again.tensors) == list(first.tensors)
    for name, t in first.tensors.items():
        other = again.tensors[name]
        assert (other.type_name, other.shape, other.data.dtype, other.data.shape) == \
            (t.type_name, t.shape, t.data.dtype, t.data.shape)
        assert np.array_equal(other.data, t.data), name
    assert again.type_of("blk.0.attn_q.weight") == "Q4_0"


def test_long_lists_are_read_when_first_asked_for_and_from_the_file_when_their_part_is_lost(gguf, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    tokens = _open(gguf).get("tokenizer.ggml.tokens")
    (long,) = (tmp_path / "cache").glob("*.long.json")
    assert len(tokens) == 300 and len(long.read_bytes()) > 1000
    main = json.loads(_entries(tmp_path / "cache")[0].read_text())
    assert "tokenizer.ggml.tokens" in main["long_keys"] and "tokenizer.ggml.tokens" not in main["fields"]
    _no_reader(monkeypatch)
    assert _open(gguf).get("tokenizer.ggml.tokens") == tokens
    long.unlink()
    again = _open(gguf)
    assert again.get("general.architecture") == "llama"  # the main file is enough for everything else
    read = []
    monkeypatch.setattr(gguf_file, "_reader", lambda path: read.append(path) or _REAL_READER(path))
    assert again.get("tokenizer.ggml.tokens") == tokens and again.get("tokenizer.ggml.merges") and read == [gguf]


def test_a_changed_file_is_read_again(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "m.gguf"
    copy.write_bytes(gguf.read_bytes())
    _open(copy)
    copy.write_bytes(gguf.read_bytes() + b"\0" * 32)  # another size: another entry
    read = []
    real = gguf_file._reader
    monkeypatch.setattr(gguf_file, "_reader", lambda path: read.append(path) or real(path))
    _open(copy)
    assert read == [copy] and len(list(_entries(tmp_path / "cache"))) == 2


def test_an_unreadable_entry_is_ignored_and_written_again(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    _open(gguf)
    (entry,) = _entries(tmp_path / "cache")
    entry.write_bytes(b"{not json")
    assert _open(gguf).get("general.architecture") == "llama"
    _no_reader(monkeypatch)
    assert _open(gguf).get("general.architecture") == "llama"


def test_without_a_writable_cache_or_with_it_off_every_open_reads_the_file(gguf, tmp_path, monkeypatch):
    read = []
    real = gguf_file._reader
    monkeypatch.setattr(gguf_file, "_reader", lambda path: read.append(path) or real(path))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", str(blocker / "cache"))  # under a file: cannot be made
    assert [_open(gguf).get("general.architecture") for _ in range(2)] == ["llama", "llama"]
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _open(gguf), _open(gguf)
    assert len(read) == 4 and not (tmp_path / "xdg").exists()


def test_a_cached_file_of_an_unsupported_tensor_type_is_still_refused(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    _open(gguf)
    (entry,) = _entries(tmp_path / "cache")
    entry.write_text(entry.read_text().replace('"type":"Q4_0"', '"type":"IQ4_NL"', 1))
    _no_reader(monkeypatch)
    with pytest.raises(UnsupportedModelError, match="has type IQ4_NL"):
        _open(gguf)


def test_metadata_json_cannot_keep_exactly_is_not_cached(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PYSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    odd = gguf_rewritten(gguf, tmp_path / "nan.gguf", floats={"test.not_a_number": float("nan")})  # JSON has no NaN
    assert np.isnan(_open(odd).get("test.not_a_number"))
    assert not list(_entries(tmp_path / "cache"))
    assert np.isnan(_open(odd).get("test.not_a_number"))  # read by gguf again, not null from a cache
