"""Quality versus loops used: teacher-forced cross-entropy under each exit threshold.

For every scored position the exit rule (`loopserve.exit`, the same state machine the engine
runs) reads the gate's hazards of that position's D loop outputs and picks a loop; the
position's log-probability of the true next token is taken from that loop's logits. Each
(threshold, min_loops) setting yields a cross-entropy (nats/token), a perplexity and a mean
of loops used. The control keeps the same histogram of loops but assigns it to positions at
random (seeded): if the gate carries information, the control is worse.

Teacher forcing runs every position through all D loops, exactly as the engine runs prompt
positions, so these numbers equal the engine's logprob of a first output token; they are not
the numbers of free-running decode, where an early-exited token's K/V is reused by deeper
loops of later tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from loopserve.eval.scoring import SequenceScores
from loopserve.exit import ExitMode, ExitRule, choose_exit_from_hazards


@dataclass(frozen=True, slots=True)
class SettingResult:
    """Scores of one exit setting over every scored position."""

    threshold: float
    min_loops: int
    mean_loops: float
    ce: float  # nats per token
    perplexity: float
    loop_counts: list[int]  # positions that used 1..D loops
    random_depth_ce: float  # the same histogram of loops, assigned at random


@dataclass(frozen=True)
class QualityReport:
    model: str
    source: str
    num_sequences: int
    num_tokens: int
    num_loops: int
    ce_per_loop: list[float]  # every position at fixed loops 1..D
    settings: list[SettingResult] = field(default_factory=list)
    seed: int = 0
    # Characters of the scored text (the targets' decoded text); 0 when unknown. Per-token CE
    # depends on the vocabulary; nats per character compares models with different tokenizers.
    num_chars: int = 0

    @property
    def full_depth_ce(self) -> float:
        return self.ce_per_loop[-1]

    def per_char(self, ce: float) -> float | None:
        """Nats per character of the scored text for a per-token CE (None without chars)."""
        return ce * self.num_tokens / self.num_chars if self.num_chars else None

    def to_dict(self) -> dict:
        raw = asdict(self)
        raw["full_depth_ce"] = self.full_depth_ce
        raw["full_depth_ce_per_char"] = self.per_char(self.full_depth_ce)
        for row, setting in zip(raw["settings"], self.settings, strict=True):
            row["ce_per_char"] = self.per_char(setting.ce)
        return raw


def exit_loops(hazards: torch.Tensor, rule: ExitRule) -> torch.Tensor:
    """Loops used (1..D) by each position under `rule`. hazards [D, N] -> [N] int64."""
    columns = hazards.t().tolist()
    loops = [choose_exit_from_hazards(ExitMode.OURO, rule, column) for column in columns]
    return torch.tensor(loops, dtype=torch.int64)


def ce_at_loops(target_logprobs: torch.Tensor, loops: torch.Tensor) -> float:
    """Mean negative log-probability with each position read at its loop. [D, N], [N]."""
    picked = target_logprobs.gather(0, (loops - 1).unsqueeze(0)).squeeze(0)
    return float(-picked.double().mean())


def evaluate_setting(
    scores: SequenceScores, threshold: float, min_loops: int, seed: int
) -> SettingResult:
    num_loops = scores.hazards.shape[0]
    rule = ExitRule(min_loops=min_loops, max_loops=num_loops, threshold=threshold)
    loops = exit_loops(scores.hazards, rule)
    ce = ce_at_loops(scores.target_logprobs, loops)
    generator = torch.Generator().manual_seed(seed)
    shuffled = loops[torch.randperm(len(loops), generator=generator)]
    counts = torch.bincount(loops - 1, minlength=num_loops).tolist()
    return SettingResult(
        threshold=threshold,
        min_loops=min_loops,
        mean_loops=float(loops.double().mean()),
        ce=ce,
        perplexity=math.exp(ce),
        loop_counts=counts,
        random_depth_ce=ce_at_loops(scores.target_logprobs, shuffled),
    )


def evaluate(
    scores: SequenceScores,
    *,
    thresholds: list[float],
    min_loops_list: list[int],
    model: str,
    source: str,
    num_sequences: int,
    seed: int = 0,
    num_chars: int = 0,
) -> QualityReport:
    num_loops, num_tokens = scores.target_logprobs.shape
    ce_per_loop = [float(-scores.target_logprobs[d].double().mean()) for d in range(num_loops)]
    settings = [
        evaluate_setting(scores, threshold, min_loops, seed)
        for min_loops in min_loops_list
        for threshold in thresholds
    ]
    return QualityReport(
        model=model, source=source, num_sequences=num_sequences, num_tokens=num_tokens,
        num_loops=num_loops, ce_per_loop=ce_per_loop, settings=settings, seed=seed,
        num_chars=num_chars,
    )  # fmt: skip


def format_table(report: QualityReport) -> str:
    lines = [
        f"model {report.model}  data {report.source}  "
        f"{report.num_tokens} tokens in {report.num_sequences} sequences",
        "fixed depth: "
        + "  ".join(f"{d + 1} loops CE {ce:.4f}" for d, ce in enumerate(report.ce_per_loop)),
        f"{'threshold':>9} {'min_loops':>9} {'mean_loops':>10} {'CE':>8} {'ppl':>8} "
        f"{'dCE_full':>8} {'random_CE':>9}  loops 1..{report.num_loops}",
    ]
    full_per_char = report.per_char(report.full_depth_ce)
    if full_per_char is not None:
        lines.insert(
            2,
            f"per character: {report.num_chars} chars scored "
            f"({report.num_chars / report.num_tokens:.3f} chars/token), full depth "
            f"{full_per_char:.4f} nats/char",
        )
    for s in report.settings:
        delta = s.ce - report.full_depth_ce
        lines.append(
            f"{s.threshold:>9.2f} {s.min_loops:>9d} {s.mean_loops:>10.3f} {s.ce:>8.4f} "
            f"{s.perplexity:>8.2f} {delta:>+8.4f} {s.random_depth_ce:>9.4f}  {s.loop_counts}"
        )
    return "\n".join(lines)


def plot_report(report: QualityReport, path: str) -> None:
    """Write the quality-versus-compute curve as a PNG; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from loopserve.errors import LoopserveError

        raise LoopserveError(
            "--plot needs matplotlib: pip install 'loopserve[bench]' (or matplotlib)"
        ) from None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    depths = list(range(1, report.num_loops + 1))
    ax.plot(depths, report.ce_per_loop, "s--", color="gray", label="fixed depth")
    for min_loops in sorted({s.min_loops for s in report.settings}):
        rows = sorted((s for s in report.settings if s.min_loops == min_loops),
                      key=lambda s: s.mean_loops)  # fmt: skip
        xs = [s.mean_loops for s in rows]
        ax.plot(xs, [s.ce for s in rows], "o-", label=f"gate exit (min_loops {min_loops})")
        ax.plot(xs, [s.random_depth_ce for s in rows], "x:", label=f"random depth ({min_loops})")
        for s in rows:
            ax.annotate(f"{s.threshold:g}", (s.mean_loops, s.ce), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)  # fmt: skip
    ax.set_xlabel("mean loops per token")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"quality vs depth: {report.num_tokens} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
