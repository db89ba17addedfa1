"""The server app and its engine in the test's own event loop, reached through httpx's ASGI
transport (no socket, no subprocess): for tests of request handling."""

from __future__ import annotations

import contextlib


@contextlib.asynccontextmanager
async def serving(model_dir, served_model_name: str = "tiny", **engine_settings):
    """(engine, client) for the app serving `model_dir`; `engine_settings` go to EngineConfig."""
    import httpx

    from pyserve.engine.async_engine import AsyncEngine
    from pyserve.engine.config import EngineConfig
    from pyserve.server.app import build_app
    from pyserve.server.settings import ServerSettings

    engine = AsyncEngine(EngineConfig(model=str(model_dir), **engine_settings))
    app = build_app(engine, ServerSettings(served_model_name=served_model_name))
    await engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            yield engine, client
    finally:
        await engine.stop()
