"""Structured logs: one JSON object per line (structlog), configured once by the CLI, and the
process's age their start-up events report."""

from __future__ import annotations

import logging
import os
import sys
import time

import structlog

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


class _Stderr:
    """Whatever sys.stderr is when a line is written (a test that captured it has closed its own)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: int = logging.INFO) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=True,
    )
