"""Repeated errors logged once per interval: a step that fails the same way every time (a broken model
path, a bad kernel) would otherwise log a traceback per step - thousands a minute, and the log that should
say what went wrong becomes the problem.

A distinct error is the logged message's format and the exception's type, text and innermost frame. Its
first record goes through whole, traceback and all. The same error again within `interval` seconds is
dropped and counted; the first one after that goes through as one line without its traceback, saying how
many were dropped, and starts the next interval. Records without an exception are never held back.
"""
from __future__ import annotations

import logging
import time
import traceback
from collections import OrderedDict
from typing import Callable


class RepeatedErrors(logging.Filter):
    """A logger's filter: each distinct error's traceback once, then a line per `interval` with a count."""

    MAX_ERRORS = 256  # distinct errors remembered; the oldest is forgotten first (and logged whole again)

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self.clock = clock
        # error -> (when its last line went out, records dropped since)
        self._seen: OrderedDict[tuple, tuple[float, int]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[1] is None:
            return True
        exc = record.exc_info[1]
        frames = traceback.extract_tb(exc.__traceback__)
        where = (frames[-1].filename, frames[-1].lineno) if frames else None
        key = (record.name, str(record.msg), type(exc).__qualname__, str(exc), where)
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None:
            self._seen[key] = (now, 0)
            if len(self._seen) > self.MAX_ERRORS:
                self._seen.popitem(last=False)
            return True
        last, dropped = seen
        self._seen.move_to_end(key)
        if now - last < self.interval:
            self._seen[key] = (last, dropped + 1)
            return False
        self._seen[key] = (now, 0)
        record.msg = (f"{record.getMessage()} - {type(exc).__name__}: {exc} (again; {dropped} more like it in the "
                      f"last {now - last:.0f} s left out, the traceback with the first)")
        record.args = None
        record.exc_info = record.exc_text = None
        return True
