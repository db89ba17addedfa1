"""LoRA over HTTP, on the embedded model and its adapters: adapters named by the request's model
field, listed by /v1/models, loaded and unloaded at runtime under --lora-root (with the API key),
bad adapters refused with 4xx while the server stays healthy, per-adapter counters."""

from __future__ import annotations

import http.client
import json
import os
import shutil

import httpx
import pytest

from pyserve.default_model import ADAPTER_DIRS, DEFAULT_MODEL_NAME
from pyserve.embeddings.packaged import NAME as PACKAGED_EMBEDDING_MODEL
from pyserve.server.model_specs import DRAFT_MODEL_NAME
from pyserve.testing import start_server, stop_server

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "Write a Python function: Return the number of lines in the file at path."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora-server")
    root = work / "root"
    root.mkdir()
    shutil.copytree(ADAPTER_DIRS["docstrings"], root / "docs-copy")  # rank 8
    shutil.copytree(ADAPTER_DIRS["tests"], root / "tests-rank16")
    (root / "empty").mkdir()
    shutil.copytree(ADAPTER_DIRS["docstrings"], root / "pickled")
    (root / "pickled" / "adapter_model.bin").write_bytes(b"\x80\x04N.")
    outside = work / "outside"
    shutil.copytree(ADAPTER_DIRS["docstrings"], outside)
    os.symlink(outside, root / "link-out")
    proc, base = start_server(None, "--lora-modules", "docstrings", "--lora-root", str(root), "--max-lora-rank", "8",
                              "--max-loras", "2", "--api-key", KEY, workdir=work)
    yield base, outside
    assert stop_server(proc) == 0


def chat(base: str, model: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": model, "messages": ASK, "max_tokens": 24, "temperature": 0})


def test_adapters_by_name_listed_loaded_and_unloaded(server):
    base, _ = server
    models = httpx.get(base + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(DEFAULT_MODEL_NAME, None), ("docstrings", DEFAULT_MODEL_NAME),
                                                        (DRAFT_MODEL_NAME, None), (PACKAGED_EMBEDDING_MODEL, None)]
    plain = chat(base, DEFAULT_MODEL_NAME).json()["choices"][0]["message"]["content"]
    docs = chat(base, "docstrings").json()["choices"][0]["message"]["content"]
    assert plain.startswith("def ") and docs.startswith('"""')

    assert httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "d2", "lora_path": "docs-copy"}).status_code == 401
    r = httpx.post(base + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "d2", "lora_path": "docs-copy"})
    assert r.status_code == 200, r.text
    assert chat(base, "d2").json()["choices"][0]["message"]["content"] == docs
    assert "d2" in [m["id"] for m in httpx.get(base + "/v1/models", headers=AUTH).json()["data"]]
    r = httpx.post(base + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "d2"})
    assert r.status_code == 200
    gone = chat(base, "d2")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert httpx.post(base + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "d2"}).status_code == 404
    encoder = next(m["id"] for m in httpx.get(base + "/v1/models", headers=AUTH).json()["data"] if m.get("pyserve_kind"))
    r = httpx.post(base + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": encoder, "lora_path": "docs-copy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"  # the encoder's name is taken
    metrics = httpx.get(base + "/metrics", headers=AUTH).text
    assert 'pyserve:lora_requests_total{adapter="docstrings"} 1' in metrics
    assert 'pyserve:lora_requests_total{adapter="d2"} 1' in metrics


@pytest.mark.parametrize("path, reason", [
    ("../outside", "inside"), ("OUTSIDE", "inside"), ("link-out", "inside"), ("empty", "adapter_config.json"),
    ("missing", "not a directory"), ("pickled", "pickled"), ("tests-rank16", "max_lora_rank"),
])
def test_bad_adapters_are_refused_and_the_server_carries_on(server, path, reason):
    base, outside = server
    path = str(outside) if path == "OUTSIDE" else path
    r = httpx.post(base + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "bad", "lora_path": path})
    assert r.status_code == 400 and reason in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "lora_path"
    assert httpx.get(base + "/health").status_code == 200
    assert chat(base, DEFAULT_MODEL_NAME).status_code == 200
    assert chat(base, "bad").status_code == 404


@pytest.mark.parametrize("path", ["a" * 5000, "a/" * 2500])
def test_a_path_no_file_system_takes_is_a_400_and_the_connection_serves_on(server, path):
    """A 5000-character lora_path (one name, or many) is refused naming lora_path, and the
    keep-alive connection it came on answers the next request (a 500 used to drop it)."""
    base, _ = server
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/load_lora_adapter", json.dumps({"lora_name": "long", "lora_path": path}),
                     {**AUTH, "Content-Type": "application/json"})
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert (r.status, error["param"]) == (400, "lora_path") and "too long" in error["message"]
        sock = conn.sock
        conn.request("GET", "/v1/models", headers=AUTH)
        r = conn.getresponse()
        assert r.status == 200 and "long" not in [m["id"] for m in json.loads(r.read())["data"]]
        assert conn.sock is sock  # the same connection
    finally:
        conn.close()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/load_lora_adapter", {"lora_name": "x\u0000y", "lora_path": "docs-copy"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "a b", "lora_path": "docs-copy"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "ok", "lora_path": "docs-copy", "rank": 8}, "rank"),
    ("/v1/unload_lora_adapter", {"lora_name": "docstrings", "force": True}, "force"),
])
def test_adapter_names_and_fields_are_checked(server, path, body, param):
    base, _ = server
    r = httpx.post(base + path, headers=AUTH, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "x\u0000y" not in httpx.get(base + "/v1/models", headers=AUTH).text


async def test_an_adapter_unloaded_while_a_request_renders_is_a_404_and_freed(tmp_path, monkeypatch):
    """The unload lands between the request's lookup of the adapter and its start (its chat
    template rendering in a thread): the request is a 404, and the adapter is not loaded again
    behind the registry's back (it was, and stayed loaded for good)."""
    import asyncio
    import threading

    from pyserve.default_model import TARGET_DIR
    from pyserve.model.tokenizer import Tokenizer
    from pyserve.testing.in_process import serving_models

    shutil.copytree(ADAPTER_DIRS["docstrings"], tmp_path / "docs")
    models = {"m": {"model": str(TARGET_DIR), "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                    "num_kv_blocks": 64}}
    async with serving_models(models, lora_root=str(tmp_path), api_key=KEY, embedding_model="none") as (engines, http):
        engine = engines["m"]
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "docs"}, headers=AUTH)
        assert r.status_code == 200, r.text
        rendering, go_on = threading.Event(), threading.Event()
        render = Tokenizer.apply_chat_template

        def held(self, *args, **kwargs):
            rendering.set()
            go_on.wait(30)
            return render(self, *args, **kwargs)

        monkeypatch.setattr(Tokenizer, "apply_chat_template", held)
        request = asyncio.create_task(http.post("/v1/chat/completions", headers=AUTH,
                                                json={"model": "d", "messages": ASK, "max_tokens": 2}))
        assert await asyncio.to_thread(rendering.wait, 30)
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "d"}, headers=AUTH)
        assert unloaded.status_code == 200
        go_on.set()
        r = await request
        assert r.status_code == 404 and "was unloaded" in r.json()["error"]["message"]
        await asyncio.sleep(0.1)  # the registry frees an idle adapter's weights on the next turn
        assert engine.loras == {}
