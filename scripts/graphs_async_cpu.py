"""Sync vs async scheduling vs graph emulation on CPU: identical outputs, step counts.

Run: PYTHONPATH=. python scripts/graphs_async_cpu.py [--device cuda]
Prints, for each variant, whether tokens and exit depths equal the synchronous eager run,
wall time, steps, steps scheduled ahead, graph calls, padding rows, core calls and rows.
On CPU the wall times only show that nothing got much slower; they say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from loopserve.engine.llm_engine import LLMEngine
from loopserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, exit_threshold=0.5, ignore_eos=True)

    def run(**extra):
        engine = LLMEngine.from_engine_args(
            dtype="float32",
            device=args.device,
            max_num_seqs=16,
            max_model_len=256,
            exit_mode="ouro_delayed",
            **extra,
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        start, outputs = time.perf_counter(), {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = (out.token_ids, out.exit_depths)
        return outputs, time.perf_counter() - start, engine.stats

    base, _, _ = run(enforce_eager=True)
    variants = [
        {"enforce_eager": True},
        {"enforce_eager": True, "async_scheduling": True},
        {"graph_mode": "emulate"} if args.device == "cpu" else {},
        {"graph_mode": "emulate" if args.device == "cpu" else "auto", "async_scheduling": True},
    ]
    for extra in variants:
        outputs, wall, s = run(**extra)
        print(
            f"{extra}: same={outputs == base} wall={wall:.2f}s steps={s.num_steps} "
            f"ahead={s.num_steps_scheduled_ahead} graph_calls={s.num_graph_calls} "
            f"padded={s.num_padded_rows} core_calls={s.num_core_calls} rows={s.num_rows}"
        )


if __name__ == "__main__":
    main()
