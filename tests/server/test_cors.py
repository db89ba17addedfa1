"""--allowed-origins: browser pages of the named origins may call the API (preflights answered
before the API key is checked, responses carrying Access-Control-Allow-Origin); without the flag
no CORS header is given and a preflight is refused."""

from __future__ import annotations

from pyserve.testing.in_process import serving_models

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}


async def test_the_allowed_origin_is_answered_and_others_are_not(llama_dir):
    models = {"tiny": {"model": str(llama_dir), "block_size": 4, "num_kv_blocks": 64}}
    async with serving_models(models, api_key="k", allowed_origins=[ORIGIN]) as (_, client):
        pre = await client.options("/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = await client.post("/v1/completions", json=BODY, headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert r.json()["usage"]["completion_tokens"] == 2
        unauthorized = await client.post("/v1/completions", json=BODY, headers={"Origin": ORIGIN})
        assert unauthorized.status_code == 401  # CORS opens the browser's door, not the key's
        other = await client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


async def test_without_the_flag_there_is_no_cors(llama_dir):
    models = {"tiny": {"model": str(llama_dir), "block_size": 4, "num_kv_blocks": 64}}
    async with serving_models(models) as (_, client):
        pre = await client.options("/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
        r = await client.post("/v1/completions", json=BODY, headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
