"""Repeated errors in the engine's log (shared/engine/repeated_errors.py): a step that fails the same way every
time logs its traceback once, then one line per interval with the count of those left out."""
import logging

import pytest

from epdserve.shared.engine import model_runner
from epdserve.shared.engine.repeated_errors import RepeatedErrors


@pytest.fixture()
def runner_log(monkeypatch, caplog):
    """The model runner's logger, its repeated-errors filter on a clock the test moves."""
    now = [1000.0]
    (limiter,) = [f for f in model_runner.logger.filters if isinstance(f, RepeatedErrors)]
    monkeypatch.setattr(limiter, "clock", lambda: now[0])
    monkeypatch.setattr(limiter, "_seen", type(limiter._seen)())
    caplog.set_level(logging.ERROR, logger=model_runner.logger.name)
    return now, caplog


def fail(message: str, request_id: str) -> None:
    try:
        raise AttributeError(message)
    except AttributeError:
        model_runner.logger.exception("request %s failed in the model", request_id)


def test_one_traceback_per_distinct_error_then_a_line_per_interval_with_a_count(runner_log):
    now, caplog = runner_log
    for step in range(500):  # every step fails alike, for whichever request
        fail("'_View' object has no attribute 'slot'", f"r{step % 3}")
        now[0] += 0.05
    fail("another error", "r1")  # a distinct error gets its own traceback at once
    # 500 failures within 25 s, inside one interval of 60 s: the first alone, with its traceback.
    assert [(r.getMessage(), r.exc_info[0]) for r in caplog.records] == [
        ("request r0 failed in the model", AttributeError), ("request r1 failed in the model", AttributeError)]
    caplog.clear()
    now[0] += 61
    fail("'_View' object has no attribute 'slot'", "r2")
    (line,) = caplog.records
    assert line.exc_info is None and "\n" not in line.getMessage()
    assert line.getMessage() == ("request r2 failed in the model - AttributeError: '_View' object has no attribute "
                                 "'slot' (again; 499 more like it in the last 86 s left out, the traceback with "
                                 "the first)")


def test_records_without_an_exception_are_never_held_back(runner_log):
    now, caplog = runner_log
    for _ in range(5):
        model_runner.logger.error("a plain error line")
    assert len(caplog.records) == 5
