"""Ctrl-C reaches the parent alone: it stops its worker processes itself, so that an interrupt is one
line and exit 130, not a traceback from each child."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


def ignore_sigint() -> None:
    """In a child (a pool's initializer, a worker's first line): Ctrl-C is for the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Around starting a child: an interrupt now would leave it reading half its start-up data (and
    printing that failure); a child started here also inherits the ignored SIGINT. Off the main thread,
    where signals are not delivered, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = signal.signal(signal.SIGINT, lambda sig, frame: pending.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if pending:
        raise KeyboardInterrupt
