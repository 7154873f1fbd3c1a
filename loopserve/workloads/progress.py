"""Progress for long commands: a tqdm bar on a terminal, a plain line at least every 30 s
otherwise (a log file, a pipe, CI), nothing with `--no-progress`.

`progress_bar(args, total=..., desc=..., unit=...)` returns an object with tqdm's `update`,
`set_postfix_str`, `close` and context-manager use, whichever it is.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

LINE_INTERVAL_S = 30.0


class LineProgress:
    """tqdm's interface, printed as one line per `interval_s` (and one at the end).

    With `ticker` (the default) a daemon thread prints a line whenever `interval_s` passed
    since the last one, so a line comes at least every `interval_s` even while one unit of
    work takes longer (lines printed only from `update` came up to 55 s apart). The line at
    `close` is left out when it would repeat the last one."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        *,
        stream: IO[str] | None = None,
        interval_s: float = LINE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        ticker: bool = True,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self._stream = stream if stream is not None else sys.stderr
        self._interval_s = interval_s
        self._clock = clock
        self._start_s = self._last_s = clock()
        self._postfix = ""
        self._closed = False
        self._printed: tuple[int, str] | None = None  # (n, postfix) of the last line
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if ticker:
            threading.Thread(target=self._tick, name=f"progress-{desc}", daemon=True).start()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._clock() - self._last_s >= self._interval_s:
            self._print()

    def set_postfix_str(self, text: str) -> None:
        self._postfix = text

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop.set()
            if self._printed != (self.n, self._postfix):
                self._print()

    def _tick(self) -> None:
        while not self._stop.wait(max(0.0, self._last_s + self._interval_s - self._clock())):
            if self._clock() - self._last_s >= self._interval_s:
                self._print()

    def _print(self) -> None:
        with self._lock:
            now = self._clock()
            self._last_s = now
            self._printed = (self.n, self._postfix)
            share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
            postfix = f", {self._postfix}" if self._postfix else ""
            print(
                f"{self.desc}: {self.n}/{self.total} {self.unit}{share}, "
                f"{now - self._start_s:.0f} s{postfix}",
                file=self._stream,
                flush=True,
            )

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def progress_bar(args: argparse.Namespace, *, total: int, desc: str, unit: str) -> Any:
    """`make_progress` as the command's `--no-progress` flag says."""
    enabled = not getattr(args, "no_progress", False)
    return make_progress(enabled, total=total, desc=desc, unit=unit)


def make_progress(enabled: bool, *, total: int, desc: str, unit: str) -> Any:
    """A tqdm bar when stderr is a terminal, else a `LineProgress`; when not `enabled`, a
    tqdm that draws nothing."""
    from tqdm.auto import tqdm

    if not enabled:
        return tqdm(total=total, desc=desc, unit=unit, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit)
    return LineProgress(total, desc, unit)
