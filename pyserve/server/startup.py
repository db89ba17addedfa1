"""The server's start: the engine is built in a thread while the socket already answers (`/health`
says "loading", other routes 503), then started on the event loop with the `--lora-modules`.

`status` moves once: "loading" -> "ready" (the ServerState is `app.state.pyserve`) or "failed"
(`error` set, `on_failure` called: the process is to exit non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from pyserve.server.lora_registry import LoraRegistry
from pyserve.server.settings import ServerSettings
from pyserve.server.state import ServerMetrics, ServerState

if TYPE_CHECKING:
    from pyserve.engine.async_engine import AsyncEngine

log = structlog.get_logger("pyserve.server")
_IMPORTED_AT = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started: from /proc (Linux, 10 ms resolution), elsewhere since
    this module was imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # from field 3 on: field 22 is the start time
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError):  # no /proc, no CLOCK_BOOTTIME or no sysconf
        return time.monotonic() - _IMPORTED_AT


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
    def __init__(self, app, engine: AsyncEngine | Callable[[], AsyncEngine], settings: ServerSettings,
                 on_failure: Callable[[BaseException], None] | None = None):
        """`engine`: a built engine (the server is ready at once; the lifespan starts the engine),
        or a function building one, called in a thread once the lifespan has begun."""
        self.status = "loading"
        self.error: BaseException | None = None
        self._app = app
        self._settings = settings
        self._load = engine if callable(engine) else None
        self._on_failure = on_failure
        self._started: AsyncEngine | None = None
        self._task: asyncio.Task | None = None
        if self._load is None:
            self._publish(self._state(engine))

    @property
    def in_background(self) -> bool:
        return self._load is not None

    def _state(self, engine: AsyncEngine) -> ServerState:
        return ServerState(engine, self._settings, ServerMetrics.create(engine),
                           LoraRegistry(engine, self._settings.lora_root))

    def _publish(self, state: ServerState) -> None:
        self._app.state.pyserve = state
        self.status = "ready"

    async def run(self) -> None:
        """Builds the engine (when it was not given), starts it, loads the LoRA modules, then
        publishes the ServerState and logs `server_ready` (seconds since the process started,
        and per phase)."""
        began = time.perf_counter()
        state = self._app.state.pyserve if self._load is None else self._state(await _in_thread(self._load))
        built = time.perf_counter()
        await state.engine.start()
        self._started = state.engine
        for name, path in self._settings.lora_modules.items():
            await state.loras.add(name, path)
        self._publish(state)
        log.info("server_ready", model=self._settings.served_model_name, max_model_len=state.engine.max_model_len,
                 kv_blocks=state.engine.num_kv_blocks, seconds=round(process_seconds(), 3),
                 load_seconds=round(built - began, 3), start_seconds=round(time.perf_counter() - built, 3))

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
        if self._started is not None:
            await self._started.stop()
