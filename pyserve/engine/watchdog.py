"""The watchdog: notices an engine that holds requests but completes no step."""

from __future__ import annotations

import time

import anyio
import structlog

from pyserve.actors import Actor

log = structlog.get_logger("pyserve.engine")


class Watchdog(Actor):
    """Every `timeout / 4` seconds, asks the EngineCore how long it has held unfinished requests
    without completing a step that ran any (a hung forward, or requests that never fit). Past
    `timeout` the engine is `stalled`: logged once per stall, and the server's /health answers
    503 until a step completes again."""

    def __init__(self, engine_core, timeout: float):
        super().__init__("watchdog")
        self.engine_core = engine_core
        self.timeout = timeout
        self.stalled_for = 0.0  # seconds without progress, once past `timeout`; else 0

    @property
    def stalled(self) -> bool:
        return self.stalled_for > 0.0

    def check(self, now: float) -> bool:
        waited = self.engine_core.seconds_without_progress(now)
        if waited <= self.timeout:
            if self.stalled:
                log.warning("engine_progressing_again", stalled_s=round(self.stalled_for, 3))
            self.stalled_for = 0.0
            return False
        if not self.stalled:
            stats = self.engine_core.stats()
            log.error("engine_stalled", seconds_without_step=round(waited, 3), timeout_s=self.timeout,
                      running=stats["num_requests_running"], waiting=stats["num_requests_waiting"])
        self.stalled_for = waited
        return True

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.timeout / 4)
            self.check(time.monotonic())
