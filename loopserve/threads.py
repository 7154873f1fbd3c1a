"""The CPU thread policy of every command (`generate`, `serve`, `bench ...`, `eval`).

On CPU, torch's default (one intra-op thread per core) fights every other process for the
cores: on a busy 2-core machine the README's `generate` call took 5.5-13.7 s with torch's
default against 0.43 s with one thread, and the server measured ~17x lower throughput with 2
threads than with 1 (its event loop needs a core). So a command runs torch with, in order:
its `--threads` flag when given (> 0), else `OMP_NUM_THREADS` when set (torch already reads
it), else cores - 1 (at least 1). Accelerator devices are left alone. The Python API (`LLM`)
does not change a process-wide setting it did not create; call `apply_cpu_threads` (or
`torch.set_num_threads`) yourself.
"""

from __future__ import annotations

import os

THREADS_ENV = "OMP_NUM_THREADS"
THREADS_HELP = "torch intra-op threads on CPU (None: cores - 1; OMP_NUM_THREADS overrides)"


def add_threads_arg(parser) -> None:
    """The `--threads` flag of a command that applies this policy."""
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)


def resolve_cpu_threads(requested: int | None) -> int | None:
    """The thread count the policy picks; None: leave torch as it is (OMP_NUM_THREADS)."""
    if requested is not None and requested > 0:
        return requested
    if os.environ.get(THREADS_ENV):
        return None
    return max(1, (os.cpu_count() or 1) - 1)


def apply_cpu_threads(device: str | None, requested: int | None) -> int | None:
    """Set torch's intra-op threads by the policy when `device` is the CPU; returns what was
    set (None: nothing changed)."""
    if device is not None and not str(device).startswith("cpu"):
        return None
    threads = resolve_cpu_threads(requested)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return threads
