"""Long commands report progress in logs too: a line at least every 30 s when stderr is not
a terminal (a tqdm bar when it is), nothing with --no-progress."""

from __future__ import annotations

import argparse
import io
import time

from loopserve.workloads import progress
from loopserve.workloads.progress import LineProgress, progress_bar


def test_a_line_every_interval_and_one_at_the_end():
    now = [0.0]
    out = io.StringIO()
    bar = LineProgress(
        100, "simulate", "req", stream=out, interval_s=30.0, clock=lambda: now[0], ticker=False
    )
    with bar:
        for _ in range(100):
            now[0] += 1.0  # one request per simulated second
            bar.update(1)
            if bar.n == 50:
                bar.set_postfix_str("arm refill")
    lines = out.getvalue().splitlines()
    assert lines == [
        "simulate: 30/100 req (30%), 30 s",
        "simulate: 60/100 req (60%), 60 s, arm refill",
        "simulate: 90/100 req (90%), 90 s, arm refill",
        "simulate: 100/100 req (100%), 100 s, arm refill",
    ]


def test_the_last_line_is_not_printed_twice():
    """The update that reaches the total printed its line (the interval had passed); closing
    adds no copy of it."""
    now = [0.0]
    out = io.StringIO()
    bar = LineProgress(2, "bench", "run", stream=out, interval_s=5.0, clock=lambda: now[0],
                       ticker=False)  # fmt: skip
    with bar:
        for _ in range(2):
            now[0] += 6.0
            bar.update(1)
    assert out.getvalue().splitlines() == [
        "bench: 1/2 run (50%), 6 s",
        "bench: 2/2 run (100%), 12 s",
    ]


def test_a_line_comes_while_one_unit_of_work_outlasts_the_interval():
    """No `update` for a while (one long unit of work): the ticker still prints lines. The
    waits bound how long the test may take; no speed is asserted."""
    out = io.StringIO()
    bar = LineProgress(1, "eval", "window", stream=out, interval_s=0.05)
    try:
        deadline_s = time.monotonic() + 10.0
        while out.getvalue().count("\n") < 2 and time.monotonic() < deadline_s:
            time.sleep(0.02)
    finally:
        bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and lines[0].startswith("eval: 0/1 window (0%)")


def test_the_kind_of_progress_follows_stderr_and_the_flag(monkeypatch):
    class FakeStderr(io.StringIO):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    on = argparse.Namespace(no_progress=False)
    off = argparse.Namespace(no_progress=True)
    monkeypatch.setattr(progress.sys, "stderr", FakeStderr(False))
    assert isinstance(progress_bar(on, total=3, desc="x", unit="run"), LineProgress)
    quiet = progress_bar(off, total=3, desc="x", unit="run")
    assert not isinstance(quiet, LineProgress) and quiet.disable
    monkeypatch.setattr(progress.sys, "stderr", FakeStderr(True))
    drawn = progress_bar(on, total=3, desc="x", unit="run")
    assert not isinstance(drawn, LineProgress) and not drawn.disable
    drawn.close()
