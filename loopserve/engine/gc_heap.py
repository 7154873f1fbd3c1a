"""A serving process's garbage-collector policy: its start-up heap is frozen.

A serving process builds a large heap at start-up that lives as long as it does: the torch,
Triton, FastAPI and pydantic modules, the model's modules and parameters, the engine. CPython's
cyclic collector walks every object of the generations it collects, and its full
collections (the oldest generation, run when enough objects have survived younger ones)
walk all of that again, holding the GIL: the engine thread and the event loop both stop. A
loaded tiny-model serving process tracks about 190,000-210,000 objects; serving 384 requests
in-process ran one full collection, 126-139 ms long (docs/benchmarks.md, "Garbage collection
while serving").

`freeze_startup_heap` runs once, after the engine has loaded and before requests arrive: it
collects what is garbage already, then moves every object alive into the permanent
generation, which collections skip (no full collection ran in the same 384 requests, and
one forced walks only what was made since: 0.04-0.18 ms). Objects made afterwards
(requests, outputs) are collected as before. It is for a
process that serves until it exits (`loopserve serve`, a Ray replica): an object frozen that
later becomes cyclic garbage is never collected, so the library's `LLM` and `LLMEngine`
never freeze the heap of the process that uses them. vLLM freezes its engine process's
start-up heap the same way.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
