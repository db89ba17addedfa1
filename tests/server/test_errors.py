"""Errors a client can cause: one status and OpenAI type each, one JSON shape."""

from __future__ import annotations

import orjson
import pytest

from pyserve.server.errors import BadRequest, NotFound, TooManyRequests, Unauthorized, Unavailable, error_response


@pytest.mark.parametrize("cls, status, type_", [
    (BadRequest, 400, "invalid_request_error"), (Unauthorized, 401, "authentication_error"),
    (NotFound, 404, "not_found_error"), (TooManyRequests, 429, "rate_limit_error"),
    (Unavailable, 503, "service_unavailable"),
])
def test_each_error_has_its_status_type_and_openai_body(cls, status, type_):
    r = error_response(cls("max_tokens: too big", param="max_tokens"))
    assert r.status_code == status
    assert orjson.loads(r.body) == {"error": {"message": "max_tokens: too big", "type": type_, "param": "max_tokens",
                                              "code": None}}
    assert (r.headers.get("www-authenticate") == "Bearer") == (status == 401)
    assert (r.headers.get("retry-after") == "1") == (status == 429)  # a full queue: try again shortly
