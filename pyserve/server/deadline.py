"""Running pure-Python work (a chat template render) off the event loop, under a deadline."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any


# While a render runs, the interpreter hands the GIL over every millisecond instead of every 5: a
# template spinning in pure Python held the event loop waiting for the GIL for 0.3-0.9 s of its
# 1 s budget when two ran at once (0.1-0.16 s with this).
RENDER_SWITCH_INTERVAL = 0.001


class _SwitchInterval:
    """Lowers sys.getswitchinterval() while at least one worker runs; restores it after the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._saved = sys.getswitchinterval()

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, RENDER_SWITCH_INTERVAL))
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                sys.setswitchinterval(self._saved)


_switching = _SwitchInterval()


class DeadlineExceeded(Exception):
    """The work ran past its deadline; it has been interrupted."""


class _Interrupt(BaseException):
    """Raised inside the worker thread, at its next bytecode, to stop overdue work."""


async def run_with_deadline(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """fn(*args) in a thread of its own; past `timeout` seconds the caller gets DeadlineExceeded
    and the thread gets an asynchronous _Interrupt, which stops Python code such as template
    loops (code stuck inside one C call stops when that call returns). The lock makes sure the
    interrupt is only ever sent while fn runs."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    lock = threading.Lock()
    running = True

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def target() -> None:
        nonlocal running
        result, error = None, None
        try:
            try:
                result = fn(*args)
            finally:
                with lock:
                    running = False
        except _Interrupt:
            error = DeadlineExceeded(f"interrupted after {timeout} s")
        except BaseException as e:  # handed to the caller
            error = e
        finally:
            _switching.exit()
        loop.call_soon_threadsafe(settle, result, error)

    thread = threading.Thread(target=target, name="deadline-worker", daemon=True)
    _switching.enter()
    try:
        thread.start()
    except BaseException:
        _switching.exit()
        raise
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout)
    except TimeoutError:
        done.cancel()  # a late result is dropped
        with lock:
            if running:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Interrupt))
        raise DeadlineExceeded(f"took longer than {timeout} s") from None
