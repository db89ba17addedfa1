"""How many background requests (batch-job lines) a step may run.

A background step that is long when an interactive request arrives delays its first token by
what is left of that step, and its decode steps by every background row beside it. So while
interactive requests run, and for INTERACTIVE_HOLD seconds after the last one (interactive
traffic comes in bursts: the next request is likely to follow), a step runs at most
`max_busy` background requests; the rest keep their KV blocks and wait. Otherwise batch jobs
fill the step.
"""

from __future__ import annotations

INTERACTIVE_HOLD = 1.0  # seconds


class BackgroundLimit:
    def __init__(self, max_busy: int):
        self.max_busy = max_busy
        self.last_interactive = float("-inf")  # time.monotonic() of the last step that saw one

    def limit(self, interactive: bool, now: float) -> int | None:
        """The most background requests the next step may run (None: no limit), given whether
        an interactive (foreground) request is running or waiting `now`."""
        if interactive:
            self.last_interactive = now
        return self.max_busy if now - self.last_interactive <= INTERACTIVE_HOLD else None
