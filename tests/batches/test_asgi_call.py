"""post_json: one JSON POST to an ASGI app in process, as a client over HTTP would see it."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pyserve.batches.asgi_call import post_json


async def echo(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"got": body, "auth": request.headers.get("authorization")}, status_code=201)


async def broken(request: Request) -> JSONResponse:
    raise RuntimeError("boom")


APP = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/broken", broken, methods=["POST"])])


def test_the_body_headers_and_status_arrive_as_over_http():
    status, payload = asyncio.run(post_json(APP, "/echo", {"a": [1, 2]}, {"Authorization": "Bearer k"}))
    assert (status, payload) == (201, {"got": {"a": [1, 2]}, "auth": "Bearer k"})


def test_an_exception_in_the_app_is_its_500_not_the_callers():
    # Starlette answers the exception with a plain-text 500: not JSON, so the caller gets a ValueError
    # it records for the line, while the app's exception itself stays inside the app.
    with pytest.raises(ValueError):
        asyncio.run(post_json(APP, "/broken", {}, {}))
