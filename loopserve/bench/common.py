"""Machinery shared by the offline benchmarks (`bench throughput`, `wcpb`, `interference`):
the synthetic checkpoint, KV sizing, seeded prompts, medians, machine info and output files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from dataclasses import fields
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from loopserve.errors import ConfigError, ModelLoadError
from loopserve.models.config import OuroConfig
from loopserve.models.loader import resolve_model_path
from loopserve.models.tiny import make_tiny_checkpoint

T = TypeVar("T")


def model_dir_for(args: argparse.Namespace, tmp: str, max_positions: int) -> Path:
    """A synthetic checkpoint in `tmp` (or the `--model` checkpoint)."""
    if args.model is not None:
        return resolve_model_path(
            args.model, revision=args.revision, download_dir=args.download_dir
        )
    names = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size", "seed")
    sizes = {name: getattr(args, name) for name in names}
    positions = max(4096, max_positions)
    return make_tiny_checkpoint(
        tmp, total_ut_steps=args.loops, max_position_embeddings=positions, **sizes
    )


def ouro_config(model_dir: Path, bench: str) -> OuroConfig:
    """The checkpoint's Ouro config; for another family, a usage error naming `bench` (the
    prompt benchmarks replay exit traces, which only Ouro's gate runs)."""
    try:
        return OuroConfig.from_file(Path(model_dir) / "config.json")
    except ModelLoadError as err:
        raise ConfigError(f"bench {bench} runs Ouro checkpoints only: {err}") from None


def blocks_for(positions: list[int], block_size: int, num_loops: int) -> int:
    """KV blocks that hold every request at once (admission never waits on KV)."""
    return sum(-(-p // block_size) * num_loops for p in positions)


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def median_of(runs: list[T]) -> T:
    """Field-wise median of dataclass results."""
    names = [f.name for f in fields(runs[0])]  # type: ignore[arg-type]
    return type(runs[0])(**{n: statistics.median(getattr(r, n) for r in runs) for n in names})


def machine_info(**extra: object) -> dict[str, object]:
    """CPU, torch version and threads, plus `extra` fields (recorded with every result)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": models[0] if models else platform.processor(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        **extra,
    }


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def write_json(result: object, path: str | os.PathLike) -> Path:
    """Write a benchmark's JSON result (parent directories made); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def write_outputs(result: dict, args: argparse.Namespace, plot) -> None:
    """Write the JSON result and the figure `plot(result)` next to it."""
    result["machine"]["loadavg_1m_end"] = os.getloadavg()[0]
    out = write_json(result, args.output_json)
    path = Path(args.figure) if args.figure else out.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plot(result)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    print(f"wrote {out} and {path}")
