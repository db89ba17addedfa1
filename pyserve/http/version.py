"""GET /version, as the server and the replica front answer it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

import pyserve
from pyserve.http.responses import json_response


async def version_info(request: Request) -> Response:
    return json_response({"version": pyserve.__version__})
