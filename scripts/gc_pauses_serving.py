"""Garbage-collection pauses while serving, with the start-up heap frozen or not.

An `AsyncLLM` (the server's engine thread) on the embedded tiny checkpoint, in a process
that has also imported the HTTP server's modules (FastAPI, pydantic: a server's heap),
serves ROUNDS x WAVE greedy requests (prompts of 5-59 tokens, 20-119 output tokens, WAVE at a
time), and every collection the collector runs meanwhile is timed through `gc.callbacks`.
Prints, per generation, how many collections ran, their total and their longest pause;
"full" is the oldest generation's, the one that walks the whole heap. Each collection holds
the GIL: the engine thread and the event loop both wait. Run from the repository root, once
each way, one run at a time:

    .venv/bin/python scripts/gc_pauses_serving.py --freeze-heap
    .venv/bin/python scripts/gc_pauses_serving.py --no-freeze-heap
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

import loopserve.server.api_server  # noqa: F401 - a server's heap (FastAPI, pydantic)
from loopserve.engine.async_llm import AsyncLLM
from loopserve.engine.llm_engine import LLMEngine
from loopserve.models.tiny import make_tiny_checkpoint
from loopserve.sampling_params import SamplingParams

ROUNDS, WAVE = 6, 64


class Pauses:
    """Every collection's duration, by generation (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.by_generation: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start_s = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start_s = time.perf_counter()
        else:
            self.by_generation[info["generation"]].append(time.perf_counter() - self._start_s)


async def serve(model_dir: Path, freeze_heap: bool, pauses: Pauses) -> float:
    llm = AsyncLLM(
        lambda: LLMEngine.from_engine_args(
            model=str(model_dir), dtype="float32", num_blocks=2048, block_size=16,
            max_num_seqs=WAVE,
        ),
        freeze_heap=freeze_heap,
    )  # fmt: skip
    llm.start()
    assert await llm.wait_ready(60.0)
    gc.callbacks.append(pauses)
    rng = random.Random(0)

    async def one(request_id: str) -> None:
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(5, 60))]
        params = SamplingParams(max_tokens=rng.randrange(20, 120), temperature=0.0,
                                ignore_eos=True)  # fmt: skip
        async for _ in await llm.generate(request_id, prompt, params):
            pass

    start_s = time.perf_counter()
    try:
        for round_ in range(ROUNDS):
            await asyncio.gather(*(one(f"r{round_}-{i}") for i in range(WAVE)))
    finally:
        gc.callbacks.remove(pauses)
        await llm.shutdown(5.0)
    return time.perf_counter() - start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--freeze-heap", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp()), seed=0)
    pauses = Pauses()
    wall_s = asyncio.run(serve(model_dir, args.freeze_heap, pauses))
    print(f"start-up heap {'frozen' if args.freeze_heap else 'not frozen'}: "
          f"{ROUNDS * WAVE} requests in {wall_s:.1f} s")  # fmt: skip
    for generation, name in ((0, "young"), (1, "middle"), (2, "full")):
        times = pauses.by_generation[generation]
        longest = max(times, default=0.0)
        print(f"  {name} collections: {len(times)}, {sum(times) * 1e3:.1f} ms in all, "
              f"longest {longest * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
