"""The server app and its engine in the test's own event loop, reached through httpx's ASGI
transport (no socket, no subprocess): for tests of request handling."""

from __future__ import annotations

import contextlib


@contextlib.asynccontextmanager
async def serving(model_dir, served_model_name: str = "tiny", **engine_settings):
    """(engine, client) for the app serving `model_dir`; `engine_settings` go to EngineConfig."""
    async with serving_models({served_model_name: {"model": str(model_dir), **engine_settings}}) as (engines, client):
        yield engines[served_model_name], client


@contextlib.asynccontextmanager
async def serving_models(models: dict[str, dict], policies: dict[str, dict] | None = None, **settings):
    """(engines by name, client) for the app serving each name's EngineConfig fields, the first
    as the primary; `policies`: a name's request policy as its models file entry gives it; `settings`
    go to ServerSettings."""
    import httpx

    from pyserve.engine.async_engine import AsyncEngine
    from pyserve.config import EngineConfig
    from pyserve.server.app import build_app
    from pyserve.server.models import ModelSpec
    from pyserve.server.settings import ServerSettings

    engines = {name: AsyncEngine(EngineConfig(**fields)) for name, fields in models.items()}
    app = build_app({name: ModelSpec(e, policy=(policies or {}).get(name, {})) for name, e in engines.items()},
                    ServerSettings(served_model_name=next(iter(models)), **settings))
    started = []
    try:
        for engine in engines.values():
            await engine.start()
            started.append(engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            yield engines, client
    finally:
        for engine in started:
            await engine.stop()
