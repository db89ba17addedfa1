"""API fuzzing: schemathesis generates valid and invalid requests from the server's own
/openapi.json and sends them to a live server on loopback. Whatever it sends, the answer is never
a 5xx, every refusal is an OpenAI-shaped error, and the server stays healthy."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from pyserve.testing import start_server, stop_server

KEY = "fuzz-key"
EXAMPLES = 200  # per mode, spread over the operations; the model is tiny and max_model_len 64


@pytest.fixture(scope="module")
def live_server(llama_dir, tmp_path_factory):
    proc, base = start_server(llama_dir, "--served-model-name", "tiny", "--api-key", KEY, "--max-model-len", "64",
                              "--max-num-seqs", "16", "--num-kv-blocks", "256", "--block-size", "4",
                              workdir=tmp_path_factory.mktemp("fuzz"))
    yield base
    assert stop_server(proc) == 0  # drained and exited cleanly after the fuzzing


def check(case, base: str) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and {"param", "code"} <= set(error)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_server_error_and_every_error_openai_shaped(live_server, mode):
    """Cases for every operation, valid (positive) or not (negative), derandomized."""
    schema = schemathesis.openapi.from_url(f"{live_server}/openapi.json")
    schema.config.update(base_url=live_server, headers={"Authorization": f"Bearer {KEY}"}, request_timeout=60)
    seen: dict[str, int] = {}

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        seen[f"{case.method} {case.path}"] = seen.get(f"{case.method} {case.path}", 0) + 1
        check(case, live_server)

    run()
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= set(seen), seen
    assert httpx.get(f"{live_server}/health", timeout=10).json() == {"status": "ok"}
