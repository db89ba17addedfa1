"""The uvicorn server `pyserve serve` runs. On SIGTERM uvicorn stops accepting, waits up to
--shutdown-timeout seconds for the requests in flight, then cancels those left: a stream then
ends with no last event (the client reads a broken body) and uvicorn logs each cancelled request
as an exception. Shortly before the timeout this server ends the requests still answered itself,
each with an error its client reads (a 503, or a stream's error event), so that none is left
for uvicorn to cancel."""

from __future__ import annotations

import asyncio

import uvicorn

END_MARGIN_S = 0.5  # how long before the timeout (at most half of it) the requests left are ended


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets=None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        timer = None
        if timeout is not None:
            at = max(0.0, timeout - min(END_MARGIN_S, timeout / 2))
            timer = asyncio.get_running_loop().call_later(at, self._end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def _end_requests(self) -> None:
        state = getattr(self._app.state, "pyserve", None)
        if state is not None:
            state.end_requests("the server is shutting down: --shutdown-timeout ran out before this request finished")
