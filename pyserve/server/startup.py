"""The server's start: the engines are built in a thread, one model after the other, while the
socket already answers (`/health` says "loading", other routes 503), then started on the event
loop with their adapters (`--lora-modules`).

`status` moves once: "loading" -> "ready" (the ServerState is `app.state.pyserve`) or "failed"
(`error` set, `on_failure` called: the process is to exit non-zero); while a hub id's files are
fetched, it says "downloading" first.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from pyserve.batches.runner import BatchRunner
from pyserve.batches.service import BatchService
from pyserve.batches.store import BatchStore
from pyserve.server.response_store import ResponseStore
from pyserve.embeddings.load import load_encoder
from pyserve.semantic_cache.calibration import calibrate_encoder
from pyserve.server.chat_cache import ChatCache
from pyserve.server.decision import check_routes, load_route, parse_cascade, parse_route_policy
from pyserve.server.lora_registry import LoraRegistry
from pyserve.server.models import ModelSpec, ModelTable, ServedModel
from pyserve.http.errors import NotFound
from pyserve.logs import process_seconds
from pyserve.server.settings import RequestPolicy, ServerSettings
from pyserve.server.state import ServerMetrics, ServerState

if TYPE_CHECKING:
    from pyserve.embeddings.encoder import Encoder
    from pyserve.engine.async_engine import AsyncEngine

log = structlog.get_logger("pyserve.server")
async def _in_thread(fn: Callable[[], AsyncEngine]) -> AsyncEngine:
    """fn() in a daemon thread (a server stopped while it runs need not wait for it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value) -> None:
        if done.cancelled():  # the server stopped while it loaded
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def work() -> None:
        try:
            result = (True, fn())
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(deliver, *result)

    threading.Thread(target=work, name="pyserve-load", daemon=True).start()
    return await done


class Startup:
    def __init__(self, app, models: dict[str, ModelSpec], settings: ServerSettings,
                 on_failure: Callable[[BaseException], None] | None = None):
        """`models`: name -> what to serve. When every engine is built, the server is ready at
        once (the lifespan starts them); otherwise the builders are called in a thread once the
        lifespan has begun."""
        self.status = "loading"
        self.error: BaseException | None = None
        self._app = app
        self._settings = settings
        self._specs = models
        self._on_failure = on_failure
        self._started: list[AsyncEngine] = []
        self._task: asyncio.Task | None = None
        # read (router files loaded) before any model loads; checked against the models once built
        self._routes = [*map(load_route, settings.route), *map(parse_cascade, settings.cascade)]
        for name, policy in map(parse_route_policy, settings.route_policy):
            route = next((r for r in self._routes if r.name == name), None)
            if route is None:
                raise ValueError(f"route_policy: no --route or --cascade is named {name!r}")
            route.policy.update(policy)
        if not self.in_background:
            self._publish(self._state({name: spec.engine for name, spec in models.items()}, *self._build_encoder()))

    @property
    def in_background(self) -> bool:
        return any(callable(spec.engine) for spec in self._specs.values())

    def _state(self, engines: dict[str, AsyncEngine], encoder: Encoder | None, cache: ChatCache | None) -> ServerState:
        models = ModelTable([ServedModel(name, engine, LoraRegistry(engine, self._settings.lora_root),
                                         self._policy(name)) for name, engine in engines.items()])
        check_routes(self._routes, models, None if encoder is None else encoder.name)
        models.routes = {r.name: r for r in self._routes}
        if encoder is not None:
            models.elsewhere[encoder.name] = "an embedding model: use /v1/embeddings"
        return ServerState(models, self._settings, ServerMetrics.create(models, cache), encoder, cache)

    def _policy(self, name: str) -> RequestPolicy:
        """A model's request policy: its models file entry's keys over the flags' (an inconsistent pair is
        an error naming the model)."""
        try:
            return self._settings.request_policy(self._specs[name].policy)
        except ValueError as e:
            raise ValueError(f"model {name!r}: {e}") from e

    def _build_all(self) -> tuple[dict[str, AsyncEngine], Encoder | None, ChatCache | None]:
        for spec in self._specs.values():
            if spec.download is not None:
                self.status = "downloading"
                spec.download()
                self.status = "loading"
        for spec in self._specs.values():  # a model that cannot load fails here, before torch's import
            if spec.check is not None:
                spec.check()
        engines = {name: spec.engine() if callable(spec.engine) else spec.engine for name, spec in self._specs.items()}
        return (engines, *self._build_encoder())

    def _build_encoder(self) -> tuple[Encoder | None, ChatCache | None]:
        s = self._settings
        encoder = load_encoder(s.embedding_model)
        if not s.semantic_cache:
            return encoder, None
        calibration = calibrate_encoder(encoder, s.semantic_cache_error_bound)
        log.info("semantic_cache_calibrated", threshold=round(calibration.threshold, 4),
                 negatives=calibration.negatives, positives_hit=round(calibration.positives_hit, 3))
        return encoder, ChatCache(encoder, calibration, s.semantic_cache_ttl, s.semantic_cache_max_entries,
                                  s.semantic_cache_max_bytes, s.semantic_cache_sampled)

    def _publish(self, state: ServerState) -> None:
        self._app.state.pyserve = state
        self.status = "ready"

    async def run(self) -> None:
        """Builds the engines (those not given), starts them, loads their adapters, then
        publishes the ServerState and logs `server_ready` (seconds since the process started,
        and per phase)."""
        began = time.perf_counter()
        state = self._state(*await _in_thread(self._build_all)) if self.in_background else self._app.state.pyserve
        built = time.perf_counter()
        for model in state.models:
            await model.engine.start()
            self._started.append(model.engine)
        for model in state.models:
            for name, path in self._specs[model.name].lora_modules.items():
                if state.models.is_taken(name):
                    raise ValueError(f"lora_modules: {name!r} is already a served model or adapter")
                await model.loras.add(name, path)
        if self._settings.data_dir is not None:
            state.batches = self._batch_service(state)
            state.batches.runner.start()
            state.responses = ResponseStore(self._settings.data_dir, self._settings.responses_max_stored,
                                            self._settings.responses_max_age)
        self._publish(state)
        log.info("server_ready", models=[m.name for m in state.models],
                 max_model_len={m.name: m.engine.max_model_len for m in state.models},
                 kv_blocks=sum(m.engine.num_kv_blocks for m in state.models), seconds=round(process_seconds(), 3),
                 load_seconds=round(built - began, 3), start_seconds=round(time.perf_counter() - built, 3))

    def _batch_service(self, state: ServerState) -> BatchService:
        s = self._settings

        def model_served(name: str) -> bool:
            try:
                state.models.resolve(name)
            except NotFound:
                return False
            return True

        store = BatchStore(s.data_dir)
        runner = BatchRunner(store, self._app, self._app.state.internal_headers, model_served,
                             s.batch_max_in_flight, s.batch_max_lines)
        return BatchService(store, runner, s.batch_max_file_bytes)

    def begin(self) -> None:
        """run() as a task of the running loop; a failure is logged (`server_load_failed`) and
        handed to `on_failure`."""
        async def guarded() -> None:
            try:
                await self.run()
            except Exception as e:  # noqa: BLE001 - any failure to load ends the server
                self.status, self.error = "failed", e
                log.error("server_load_failed", error=repr(e), seconds=round(process_seconds(), 3))
                if self._on_failure is not None:
                    self._on_failure(e)

        self._task = asyncio.get_running_loop().create_task(guarded(), name="pyserve-startup")

    async def stop(self) -> None:
        """Ends the start if it is still under way, and stops the engine if it was started (a
        build still running in its thread is left to die with the process)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        state: ServerState | None = getattr(self._app.state, "pyserve", None)
        if state is not None:
            state.draining = True
            if state.batches is not None:  # lines in flight run again after a restart
                await state.batches.runner.stop()
                state.batches.store.close()
            if state.responses is not None:
                state.responses.close()
        for engine in self._started:
            await engine.stop()
