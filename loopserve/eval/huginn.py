"""`loopserve eval` for Huginn: cross-entropy against recurrence steps used.

Rows of the report:
- fixed r: every position teacher-forced at r steps (the authors' `model(x, num_steps=r)`);
- a criterion at a threshold: positions run one at a time, each exiting when the criterion
  fires (the authors' `_prefill_with_varied_exit_steps`; K/V lookup `last_exited`), scored
  at its exit step;
- its random-step control: the same steps, shuffled over the positions (seeded), each
  position run for exactly its drawn steps. If the criterion spends steps where they help,
  the control is worse.

Adaptive rows run one position at a time: slow on real checkpoints (a 3.5B model on a CPU
takes seconds per position), fine for a few windows.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

import torch

from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.models.huginn_dense import score_tokens, teacher_forced_logits


@dataclass(frozen=True)
class HuginnRow:
    setting: str  # "r=8", "kl<0.01"
    mean_steps: float
    ce: float  # nats per token
    control_ce: float | None = None  # the random-step control (adaptive rows)


@dataclass(frozen=True)
class HuginnReport:
    model: str
    source: str
    criterion: str
    num_sequences: int
    num_tokens: int
    rows: list[HuginnRow] = field(default_factory=list)
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def default_steps(num_loops: int) -> list[int]:
    steps = [s for s in (1, 2, 4, 8, 16, 32, 64) if s < num_loops]
    return [*steps, num_loops]


def evaluate_huginn(
    model: HuginnForLoopedLM,
    windows: torch.Tensor,
    *,
    criterion: str,
    thresholds: list[float],
    steps: list[int],
    seed: int = 0,
    model_name: str = "",
    source: str = "",
    on_window=None,
) -> HuginnReport:
    sequences = [row.tolist() for row in windows]
    num_tokens = sum(len(s) - 1 for s in sequences)
    rows = []
    for r in steps:
        total = 0.0
        for seq in sequences:
            logits = teacher_forced_logits(model, seq[:-1], num_steps=r)
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            total -= float(logprobs.gather(1, torch.tensor(seq[1:])[:, None]).sum())
        rows.append(HuginnRow(f"r={r}", float(r), total / num_tokens))
    rng = random.Random(seed)
    for threshold in thresholds:
        total, used = 0.0, []
        for seq in sequences:
            logprobs, seq_steps = score_tokens(model, seq, criterion=criterion, threshold=threshold)
            total -= float(logprobs.sum())
            used.append(seq_steps)
            if on_window is not None:
                on_window()
        flat = [s for seq_steps in used for s in seq_steps]
        shuffled = flat[:]
        rng.shuffle(shuffled)
        control, at = 0.0, 0
        for seq in sequences:
            n = len(seq) - 1
            logprobs, _ = score_tokens(model, seq, steps=shuffled[at : at + n])
            control -= float(logprobs.sum())
            at += n
        rows.append(HuginnRow(f"{criterion}<{threshold:g}", sum(flat) / len(flat),
                              total / num_tokens, control / num_tokens))  # fmt: skip
    return HuginnReport(model_name, source, criterion, len(sequences), num_tokens, rows, seed)


def format_huginn_table(report: HuginnReport) -> str:
    lines = [
        f"model {report.model}; {report.source}; {report.num_sequences} sequences, "
        f"{report.num_tokens} scored tokens; criterion {report.criterion}",
        f"{'setting':>16} {'mean steps':>10} {'CE':>8} {'ppl':>9} {'random-step CE':>15}",
    ]
    for row in report.rows:
        control = "" if row.control_ce is None else f"{row.control_ce:15.4f}"
        lines.append(
            f"{row.setting:>16} {row.mean_steps:10.2f} {row.ce:8.4f} {math.exp(row.ce):9.2f} "
            f"{control}"
        )
    return "\n".join(lines)
