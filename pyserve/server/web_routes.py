"""The browser pages: `GET /` (the playground) and `GET /dashboard`, and their scripts and style
under `/web/NAME`, all shipped in the package (pyserve/server/web: plain HTML, CSS and JS, no
build step, nothing fetched from elsewhere). The pages themselves need no key; what they fetch
(/v1/models, /v1/chat/completions, /v1/stats) does, and they ask for it when the server has one,
keeping it in the browser's localStorage."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from pyserve.http.errors import NotFound

WEB = Path(__file__).parent / "web"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}
ASSETS = {p.name: p for p in WEB.iterdir() if p.suffix in _TYPES}
PAGES = {"/": "playground.html", "/dashboard": "dashboard.html"}
PUBLIC_PATHS = frozenset({*PAGES, *(f"/web/{name}" for name in ASSETS)})
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                       "script-src 'self'; connect-src 'self'; frame-ancestors 'none'"}


def _file(name: str) -> Response:
    path = ASSETS[name]
    return FileResponse(path, media_type=_TYPES[path.suffix], headers=_HEADERS)


async def page(request: Request) -> Response:
    return _file(PAGES[request.url.path])


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in ASSETS:
        raise NotFound(f"no such file: /web/{name}")
    return _file(name)
