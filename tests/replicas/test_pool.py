"""The router's health watch over its replicas (pyserve.replicas.pool), on a stand-in transport."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pyserve.replicas.pool import ReplicaPool
from pyserve.replicas.settings import RouterSettings

URL = "http://replica.test:8000"


def _answers(failures: list[BaseException]):
    """A replica that answers /health and /v1/models, but raises failures.pop(0) on a /health
    while any are left (after the first, so that the router starts)."""
    seen = {"health": 0}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            seen["health"] += 1
            if seen["health"] > 1 and failures:
                raise failures.pop(0)
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})

    return handle, seen


@pytest.mark.parametrize("failure", [AttributeError("'NoneType' object has no attribute 'getpeername'"),
                                     httpx.ConnectError("refused")])
def test_a_check_that_fails_in_any_way_marks_the_replica_down_and_the_watch_goes_on(failure):
    """anyio raised AttributeError from getpeername() on a socket the peer closed as it was
    connected: it must not end the watch (the replica stayed out for good)."""

    async def scenario():
        handle, seen = _answers([failure, failure])
        client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        pool = ReplicaPool(RouterSettings(replica=[URL], health_interval=0.01), client)
        await pool.start()
        assert len(pool.healthy()) == 1
        down = False
        for _ in range(200):  # up to 2 s
            await asyncio.sleep(0.01)
            down = down or not pool.healthy()
            if down and pool.healthy() and seen["health"] > 4:
                break
        healthy, checks = len(pool.healthy()), seen["health"]
        await pool.stop()
        await client.aclose()
        return down, healthy, checks

    down, healthy, checks = asyncio.run(scenario())
    assert down and healthy == 1 and checks > 4
