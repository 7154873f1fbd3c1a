"""The arms the benchmarks and the simulator compare: one meaning per arm name.

An arm is a set of engine arguments (plus, for `full_depth`, "every token runs all D loops").
Every tool that names an arm takes it from `ARMS`, so `mixed` means the same everywhere:
prompt work split one loop at a time (`prefill_mode="per_depth"`) riding in the decode core
call (`mixed_prefill_decode=True`). That is what the scheduler runs for mixed steps; it also
turns an `atomic` prompt mode into `per_depth` when `mixed_prefill_decode` is set, but the
table never relies on that.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from loopserve.errors import ConfigError


@dataclass(frozen=True)
class Arm:
    name: str
    engine_args: dict[str, object] = field(default_factory=dict)
    full_depth: bool = False  # every token runs all D loops (exit distribution "full")

    @property
    def mode(self) -> str:
        """The decode policy (`refill` or `no_refill`)."""
        return str(self.engine_args.get("mode", "refill"))

    @property
    def exit_dist(self) -> str | None:
        """The exit distribution this arm forces; None: the workload's own."""
        return "full" if self.full_depth else None


ARMS: dict[str, Arm] = {
    # decode policies
    "refill": Arm("refill", {"mode": "refill"}),
    "no_refill": Arm("no_refill", {"mode": "no_refill"}),
    "full_depth": Arm("full_depth", {"mode": "refill"}, full_depth=True),
    # prompt scheduling (decode policy: the default, refill)
    "atomic": Arm("atomic", {"prefill_mode": "atomic"}),
    "per_depth": Arm("per_depth", {"prefill_mode": "per_depth"}),
    "mixed": Arm("mixed", {"prefill_mode": "per_depth", "mixed_prefill_decode": True}),
    "wavefront": Arm("wavefront", {"prefill_mode": "wavefront"}),
    "wavefront_mixed": Arm(
        "wavefront_mixed",
        {"prefill_mode": "wavefront", "mixed_prefill_decode": True},
    ),
}

DECODE_ARMS = ("full_depth", "no_refill", "refill")  # `bench throughput`
PROMPT_ARMS = ("atomic", "per_depth", "mixed", "wavefront", "wavefront_mixed")  # wcpb, interference
SIM_POLICIES = ("refill", "no_refill", "full_depth", "per_depth", "mixed", "wavefront")


def get_arm(name: str, allowed: tuple[str, ...] | None = None) -> Arm:
    names = allowed if allowed is not None else tuple(ARMS)
    if name not in names:
        raise ConfigError(f"unknown arm {name!r}; choose from {', '.join(names)}")
    return ARMS[name]


def prompt_arm_args(name: str) -> dict[str, object]:
    """Engine args of a prompt-scheduling arm (raises ConfigError for other names)."""
    return dict(get_arm(name, PROMPT_ARMS).engine_args)


def arm_list(text: str) -> list[str]:
    """argparse type: comma-separated prompt-scheduling arm names."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in PROMPT_ARMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"arms must be among {', '.join(PROMPT_ARMS)}; got {text!r}"
        )
    return names
