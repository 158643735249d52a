"""Start-up that signals can stop: loading a checkpoint and compiling the step buckets take
minutes, inside calls (an XLA compile) that Python cannot interrupt, and a signal handler only
runs when the main thread returns to the interpreter. `run_interruptible` runs that work on a
worker thread while the main thread waits in short joins, so SIGTERM and SIGINT are acted on
at once: one line on stderr, and the process ends (exit 0 for SIGTERM, 130 for SIGINT).
Nothing is served or being written during start-up (the batch CLI prepares its output file
before it), so there is nothing to drain or flush.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """A stopped start-up's exit code: 0 when asked to terminate, 130 when interrupted."""
    return 0 if signum == signal.SIGTERM else 130


def stop_now(signum: int, what: str) -> None:
    """Say which signal stopped `what`, then end the process at once (worker threads cannot be
    joined: they may be inside a compile)."""
    print(f"{signal.Signals(signum).name} during {what}: stopping", file=sys.stderr, flush=True)
    os._exit(exit_code(signum))


def run_interruptible(fn: Callable[[], T], *, what: str, poll_s: float = 0.1) -> T:
    """fn() on a worker thread; a SIGTERM or SIGINT meanwhile stops the process (`stop_now`).
    Its result, or its exception, is the caller's. Call from the main thread."""
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = e

    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in STOP_SIGNALS}
    try:
        worker = threading.Thread(target=work, name=what, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(poll_s)
            if received:
                stop_now(received[0], what)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
