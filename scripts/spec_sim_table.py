"""The simulated table of docs/speculative.md: Ouro-1.4B on an H200, ShareGPT lengths, offline
at a fixed concurrency, output tok/s with self-speculative decoding (K, d) beside plain
decoding, at full depth and with the trained gate's exit distribution (adaptive exit).

    python scripts/spec_sim_table.py [--stable 0.349,0.308,0.215,0.128] [--out table.md]

Each cell runs the real scheduler over the simulated executor (`loopserve simulate`'s
machinery); drafts are right from the loop the `--stable` distribution draws per position.
"""

from __future__ import annotations

import argparse
import time

from loopserve.sim.args import EMBEDDED_STABLE_DIST, _probs
from loopserve.sim.cost_model import OURO_1P4B
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.metrics import summarize
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import WorkloadSpec, build_workload

CONCURRENCY = (1, 8, 64)
REQUESTS = {1: 16, 8: 48, 64: 256}
CONFIGS = [(0, 1)] + [(k, d) for d in (1, 2) for k in (1, 2, 3, 4)]
EXITS = {"full depth": "full", "adaptive (ouro_1p4b_t0.5)": "ouro_1p4b_t0.5"}


def cell(concurrency: int, exit_dist: str, k: int, d: int, stable, max_seqs: int) -> float:
    workload = build_workload(
        WorkloadSpec(REQUESTS[concurrency], exit_dist=exit_dist, seed=0), OURO_1P4B.num_loops
    )
    sim = Simulator(
        OURO_1P4B,
        get_device_profile("h200"),
        {
            "max_num_seqs": max(concurrency, 1),
            "speculative_tokens": k,
            "draft_loops": d,
            "speculative_max_seqs": max_seqs,
        },
        draft_stable_dist=stable,
    )
    run = sim.run(workload, max_concurrency=concurrency)
    return summarize(run).output_throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stable", type=_probs, default=EMBEDDED_STABLE_DIST)
    parser.add_argument("--speculative-max-seqs", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    lines = []
    for label, exit_dist in EXITS.items():
        lines.append(f"\n{label}; draft stable-loop distribution {args.stable}\n")
        header = "| concurrency | plain | " + " | ".join(f"K={k} d={d}" for k, d in CONFIGS[1:])
        lines += [header + " |", "|" + " --- |" * (len(CONFIGS) + 1)]
        for concurrency in CONCURRENCY:
            values = [
                cell(concurrency, exit_dist, k, d, args.stable, args.speculative_max_seqs)
                for k, d in CONFIGS
            ]
            plain = values[0]
            row = [f"{plain:,.0f}"] + [f"{v:,.0f} ({v / plain:.2f}x)" for v in values[1:]]
            lines.append(f"| {concurrency} | " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
