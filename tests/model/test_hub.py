"""Hub ids (pyserve/model/hub.py) against a local stand-in of the hub's HTTP API: a model
downloaded (only the files it needs), cached, then served offline; a GGUF file named in a
repository; missing, gated and pickle-only repositories refused with messages naming the cause.
huggingface_hub reads HF_ENDPOINT when imported, so each download runs in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pyserve.model.errors import WeightsError
from pyserve.model.hub import check_hub_model, fetch_model
from pyserve.testing import build_model, start_server, stop_server
from pyserve.testing.hub_standin import HubStandIn
from pyserve.testing.tiny_gguf import gguf_from_hf

FETCH = ("import json, sys, time; from pyserve.model.hub import fetch_model\n"
         "start = time.perf_counter()\n"
         "try:\n    print(json.dumps({'path': fetch_model(sys.argv[1], (sys.argv[2:] or [None])[0], None)}))\n"
         "except ValueError as e:\n    print(json.dumps({'error': str(e), 'seconds': time.perf_counter() - start}))\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("hub") / "tiny", "qwen2")


def _fetch(model: str, env: dict[str, str], revision: str | None = None) -> dict:
    run = subprocess.run([sys.executable, "-c", FETCH, model, *([revision] if revision else [])], capture_output=True,
                         text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _completion(base: str, model: str) -> str:
    body = {"model": model, "prompt": "the cat", "max_tokens": 8, "temperature": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_hub_id_is_downloaded_then_served_offline_from_the_cache(tiny, tmp_path):
    (tiny / "pytorch_model.bin").write_bytes(b"a pickle is never fetched")
    env = {"HF_HOME": str(tmp_path / "hf")}
    with HubStandIn() as hub:
        hub.add_folder("org/tiny", tiny)
        proc, base = start_server("org/tiny", workdir=tmp_path, env={**env, "HF_ENDPOINT": hub.url})
        try:
            assert "org/tiny" in [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
            online = _completion(base, "org/tiny")
        finally:
            stop_server(proc)
        fetched = {r.rsplit("/", 1)[1] for r in hub.requests if r.startswith("GET /org/tiny/resolve/")}
        listings = [r for r in hub.requests if r.startswith("GET /api/models/org/tiny/revision/")]
        looked_up = hub.requests.count("GET /api/models/org/tiny")
    assert fetched == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json"}
    assert len(listings) == 1, hub.requests  # resolved once, though the start and the engine both ask
    assert looked_up == 1  # the repository's lookup before the socket
    proc, base = start_server("org/tiny", workdir=tmp_path, env={**env, "HF_HUB_OFFLINE": "1"})
    try:
        assert _completion(base, "org/tiny") == online
    finally:
        stop_server(proc)


def test_a_gguf_file_named_in_a_repository_is_the_only_file_fetched(tiny, tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    gguf_from_hf(tiny, folder / "tiny-f32.gguf")
    gguf_from_hf(tiny, folder / "tiny-q8_0.gguf", projections="Q8_0")
    with HubStandIn() as hub:
        hub.add_folder("org/ggufs", folder)
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "PATH": ""}
        got = _fetch("org/ggufs:tiny-q8_0.gguf", env)
        fetched = [r for r in hub.requests if r.startswith("GET /org/ggufs/resolve/")]
    assert got["path"].endswith("tiny-q8_0.gguf")
    assert len(fetched) == 1 and fetched[0].endswith("/tiny-q8_0.gguf")


def test_a_revision_is_fetched_as_named_and_one_the_repository_lacks_is_refused(tiny, tmp_path):
    with HubStandIn() as hub:
        hub.add_folder("org/tiny", tiny)
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "PATH": ""}
        commit = hub.commit("org/tiny")
        pinned, missing = _fetch("org/tiny", env, commit), _fetch("org/tiny", env, "nosuch")
    assert Path(pinned["path"]).name == commit and (Path(pinned["path"]) / "config.json").is_file()
    assert missing["error"] == "org/tiny has no revision 'nosuch'"


def test_a_gguf_file_other_than_the_one_the_id_names_is_refused_by_the_lookup_too():
    """`serve`'s lookup before its socket and the download refuse it alike, before any request."""
    for call in (check_hub_model, fetch_model):
        with pytest.raises(ValueError, match="gguf_file 'b.gguf' differs from the file the model names \\('a.gguf'\\)"):
            call("org/m:a.gguf", None, "b.gguf")


def _pickle_only(model: Path, folder: Path) -> Path:
    """A repository folder with `model`'s config and only a pickled checkpoint."""
    folder.mkdir()
    (folder / "config.json").write_text((model / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    return folder


def test_missing_gated_and_pickle_only_repositories_are_refused_naming_the_cause(tiny, tmp_path):
    pickles = _pickle_only(tiny, tmp_path / "pickles")
    with HubStandIn() as hub:
        hub.add_folder("org/gated", tiny)
        hub.gated.add("org/gated")
        hub.add_folder("org/pickles", pickles)
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "PATH": ""}
        missing, gated, pickled = (_fetch(m, env) for m in ("org/nothing", "org/gated", "org/pickles"))
    assert "org/nothing was not found on the hub" in missing["error"]
    assert "org/gated is gated" in gated["error"] and "HF_TOKEN" in gated["error"]
    assert "org/pickles has no safetensors weights" in pickled["error"]
    assert max(r["seconds"] for r in (missing, gated, pickled)) < 1.0


def test_an_unreachable_hub_fails_at_once_naming_it(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", "PATH": ""}
    got = _fetch("org/anything", env)
    assert "org/anything" in got["error"] and "reach" in got["error"]
    assert got["seconds"] < 1.0


def _serve_imports(model: str, env: dict[str, str]) -> tuple[int, str, list[str]]:
    """`pyserve serve MODEL` run to its exit: its status, its last line and the modules it imported."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "pyserve.cli", "serve", model, "--port", "9"],
                         capture_output=True, text=True, env=env, timeout=60)
    imported = [ln.rsplit("|", 1)[1].strip() for ln in run.stderr.splitlines() if ln.startswith("import time:")]
    return run.returncode, run.stderr.strip().splitlines()[-1], imported


def test_serve_refuses_repositories_it_cannot_serve_and_an_unreachable_hub_before_the_server_is_imported(
        tiny, tmp_path):
    pickles = _pickle_only(tiny, tmp_path / "pickles")
    with HubStandIn() as hub:
        hub.add_folder("org/pickles", pickles)
        hub.add_folder("org/tiny", tiny)
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "PATH": ""}
        missing, pickled, no_file = (_serve_imports(m, env) for m in ("org/nothing", "org/pickles", "org/tiny:x.gguf"))
    unreachable = _serve_imports("org/anything", {**env, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert missing[0] == pickled[0] == no_file[0] == unreachable[0] == 1
    assert "org/nothing was not found on the hub" in missing[1]
    assert "org/pickles has no safetensors weights" in pickled[1]
    assert "org/tiny has no file x.gguf" in no_file[1]
    assert "org/anything is not in the local hub cache and the hub cannot be reached" in unreachable[1]
    for _, _, imported in (missing, pickled, no_file, unreachable):
        assert "huggingface_hub" in imported and "pyserve.server.app" not in imported


PARSE = ("import json, sys; from pyserve.speculative.config import SpeculativeConfig\n"
         "try:\n    c = SpeculativeConfig.parse({'method': 'draft_model', 'model': sys.argv[1]}, None,\n"
         "                                  download=sys.argv[2] == 'download')\n"
         "    print(json.dumps({'path': c.model}))\n"
         "except ValueError as e:\n    print(json.dumps({'error': str(e)}))\n")


def test_a_draft_model_named_by_hub_id_is_downloaded(tiny, tmp_path):
    """`serve`'s check before its socket (download=False) looks the id up and fetches nothing; the
    engine's parse downloads it."""
    with HubStandIn() as hub:
        hub.add_folder("org/draft", tiny)
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url, "PATH": ""}

        def parse(model: str, how: str = "download") -> dict:
            run = subprocess.run([sys.executable, "-c", PARSE, model, how], capture_output=True, text=True, env=env,
                                 timeout=60)
            assert run.returncode == 0, run.stderr
            return json.loads(run.stdout.strip().splitlines()[-1])

        checked, missing_checked = parse("org/draft", "check"), parse("org/nothing", "check")
        fetched_by_check = (tmp_path / "hf").exists() and any((tmp_path / "hf").rglob("config.json"))
        got, missing = parse("org/draft"), parse("org/nothing")
    assert checked == {"path": "org/draft"} and not fetched_by_check
    assert missing_checked["error"].startswith("speculative_config.model: org/nothing was not found on the hub")
    assert (tmp_path / "hf") in Path(got["path"]).parents
    assert json.loads((Path(got["path"]) / "config.json").read_text()) == json.loads((tiny / "config.json").read_text())
    assert missing["error"].startswith("speculative_config.model: org/nothing was not found on the hub")


def test_gguf_file_names_a_file_of_a_folder_and_is_refused_beside_a_file(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "a.gguf").write_bytes(b"GGUF")
    assert fetch_model(str(folder), None, "a.gguf") == str(folder / "a.gguf")
    with pytest.raises(WeightsError, match="gguf_file: no b.gguf in"):
        fetch_model(str(folder), None, "b.gguf")
    with pytest.raises(WeightsError, match="is a file itself: serve it without gguf_file"):
        fetch_model(str(folder / "a.gguf"), None, "other.gguf")
