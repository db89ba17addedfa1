"""Hostile input against a live server: oversized and deeply nested bodies, huge headers,
invalid UTF-8, thousands of stop strings, out-of-vocabulary token ids, empty prompts, and request
chat templates that escape the sandbox, loop or flood. Each is answered 4xx within a bounded time
while a canary client keeps getting /health answered quickly, and the server serves normally
afterwards."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from pyserve.testing import start_server, stop_server

BODY_LIMIT = 64 * 1024
TEMPLATE_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    proc, base = start_server(llama_dir, "--served-model-name", "tiny", "--max-body-bytes", str(BODY_LIMIT),
                              "--trust-request-chat-template", "--chat-template-timeout", str(TEMPLATE_TIMEOUT),
                              "--block-size", "4", "--num-kv-blocks", "256", workdir=tmp_path_factory.mktemp("hostile"))
    yield base
    assert stop_server(proc) == 0


def raw_request(base: str, payload: bytes) -> int:
    """Sends raw bytes over a socket; returns the status code of the answer."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


def post_raw(path: str, body: bytes, extra_headers: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra_headers + b"\r\n" + body


COMPLETION = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE_JSON = [
    ("stop", "/v1/completions", COMPLETION | {"stop": [f"s{i}" for i in range(5000)]}),
    ("prompt", "/v1/completions", COMPLETION | {"prompt": [5, 10**9]}),
    ("prompt", "/v1/completions", COMPLETION | {"prompt": [-1]}),
    ("prompt", "/v1/completions", COMPLETION | {"prompt": ""}),
    ("prompt", "/v1/completions", COMPLETION | {"prompt": []}),
    ("messages", "/v1/chat/completions", CHAT | {"messages": []}),
    ("chat_template", "/v1/chat/completions", CHAT | {"chat_template": LOOP}),
    ("chat_template", "/v1/chat/completions", CHAT | {"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}),
    ("chat_template", "/v1/chat/completions", CHAT | {"chat_template": "{{ cycler.__init__.__globals__.os }}"}),
    ("chat_template", "/v1/chat/completions",
     CHAT | {"chat_template": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"}),
    ("chat_template", "/v1/chat/completions", CHAT | {"chat_template": "{{ 9 ** 999999999 }}"}),
    ("chat_template", "/v1/chat/completions",
     CHAT | {"chat_template": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"}),
]


@pytest.mark.parametrize("param, path, body", HOSTILE_JSON, ids=lambda v: v if isinstance(v, str) else "")
def test_hostile_json_is_refused_naming_the_field_in_bounded_time(server, param, path, body):
    start = time.perf_counter()
    r = httpx.post(server + path, json=body, timeout=30)
    elapsed = time.perf_counter() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert elapsed < TEMPLATE_TIMEOUT + 4, f"answered after {elapsed:.1f} s"


def test_malformed_http_is_refused_in_bounded_time(server):
    nested = b'{"model": "tiny", "prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"
    cases = {
        "over the size limit": (post_raw("/v1/completions", b'{"prompt": "' + b"x" * (2 * BODY_LIMIT) + b'"}'), 413),
        "deeply nested": (post_raw("/v1/completions", nested), 400),
        "invalid UTF-8": (post_raw("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}'), 400),
        "huge header": (post_raw("/v1/completions", json.dumps(COMPLETION).encode(),
                                 b"X-Big: " + b"a" * 200_000 + b"\r\n"), None),
        "lying Content-Length": (post_raw("/v1/completions", b"{}").replace(b"Length: 2", b"Length: abc"), 400),
    }
    for name, (payload, want) in cases.items():
        start = time.perf_counter()
        status = raw_request(server, payload)
        assert time.perf_counter() - start < 5, name
        assert status == want if want else 400 <= status < 500, f"{name}: {status}"


@pytest.mark.asyncio
async def test_the_loop_keeps_serving_other_clients_during_hostile_requests(server):
    latencies: list[float] = []
    stop = asyncio.Event()

    async def canary(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=server, timeout=30) as client:
        watcher = asyncio.create_task(canary(client))
        hostile = [client.post(path, json=body) for _, path, body in HOSTILE_JSON * 2]
        answers = await asyncio.gather(*hostile)
        served = await client.post("/v1/completions", json=COMPLETION | {"temperature": 0, "ignore_eos": True})
        stop.set()
        await watcher
    assert all(a.status_code == 400 for a in answers)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
    assert len(latencies) >= 5 and max(latencies) < 1.0, max(latencies)
