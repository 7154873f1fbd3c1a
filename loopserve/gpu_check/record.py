"""The GPU check's record: a JSON rewritten after every step, and the console log beside it.

A check on a lent GPU may be cut short (a command limit, a lost machine), so nothing it
measured may wait for the end: `CheckRecord.step` runs one step isolated from the others and
rewrites the JSON atomically as soon as it finishes; `Tee` copies the console to a log file.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path


class CheckRecord:
    """The check's JSON, rewritten (atomically) after every step, so a run cut short keeps
    every finished step: each step's status (ok, failed, skipped), wall time, result and,
    on failure, its traceback."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path = path
        self.data: dict = {**header, "steps": []}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def step(self, name: str, fn, *args):
        """Run one step isolated from the others; returns its result, or None if it failed."""
        print(f"== {name}", flush=True)
        start_s = time.perf_counter()
        entry: dict = {"name": name}
        try:
            result = fn(*args)
            entry["status"] = "ok"
        except Exception as err:  # recorded with its traceback; later steps still run
            result = None
            entry.update(status="failed", error=f"{type(err).__name__}: {err}",
                         traceback=traceback.format_exc())  # fmt: skip
            print(f"step {name!r} failed: {entry['error']}", flush=True)
        entry["wall_s"] = round(time.perf_counter() - start_s, 3)
        self.data["steps"].append(entry)
        self.write()
        return result

    def skip(self, name: str, reason: str) -> None:
        self.data["steps"].append(
            {"name": name, "status": "skipped", "reason": reason, "wall_s": 0.0}
        )
        self.write()


class Tee:
    """Console output also written to a log file beside the JSON."""

    def __init__(self, stream, path: Path) -> None:
        self.stream, self.file = stream, path.open("w")

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()
