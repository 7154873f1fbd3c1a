"""Convergence exit criteria: Huginn's per-token rules for stopping the recurrence.

Ouro decides exits with a trained hazard gate (`exit/policies.py`). Huginn has no gate; its
authors stop a token when successive recurrence steps agree. After every step (from
`min_steps` on) a criterion compares this step with the previous one and the token exits when
the value crosses the threshold:

| criterion          | value after step t                                   | exits when  | default |
| ------------------ | ---------------------------------------------------- | ----------- | ------- |
| `entropy-diff`     | abs(H(p_t) - H(p_{t-1})), H(p_{-1}) = 100            | value < thr | 1e-3    |
| `latent-diff`      | norm(s_t - s_{t-1}) / norm(s_t), s_{-1} = initial    | value < thr | 0.03    |
| `cosine`           | 1 - cos(s_t, s_{t-1}), s_{-1} = initial              | value < thr | 1e-3    |
| `kl`               | KL(p_{t-1} ‖ p_t), p_{-1} uniform                    | value < thr | 1e-3    |
| `minp-kl`          | the same over min-p filtered distributions (0.1)     | value < thr | 1e-5    |
| `argmax-stability` | steps the argmax has not changed                     | value ≥ thr | 2       |
| `none`             | never exits (fixed depth)                            |             |         |

p_t is the next-token distribution of the coda applied to state s_t, so the criteria that read
it run the coda (and the LM head) at every check. States are the raw recurrent states.

Shapes follow the authors' `reduce=True` path: a criterion sees `latents [tokens, S, hidden]`
(S positions that exit together: S = 1 when decoding, the whole prompt under the authors'
prompt semantics) and `logits [tokens, vocab]` of each token's last position. The latent
criteria average their per-position values over S. Each criterion object keeps the previous
step of the tokens it was `init`-ed with.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional as F


class ExitCriterion(Protocol):
    name: str
    needs_logits: bool
    threshold: float
    # The attributes that carry a token's state from one check to the next, each with the
    # token as its first dimension (a batched executor stores them per token between calls).
    state_fields: tuple[str, ...]

    def init(self, initial_latents: torch.Tensor) -> None: ...

    def check(
        self, latents: torch.Tensor, logits: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(exits bool [tokens], values float [tokens]) after one more step."""
        ...


class NoExit:
    name, needs_logits, threshold = "none", False, 0.0
    state_fields: tuple[str, ...] = ()

    def init(self, initial_latents: torch.Tensor) -> None:
        pass

    def check(self, latents, logits):
        zeros = torch.zeros(latents.shape[0], device=latents.device)
        return zeros.bool(), zeros


class EntropyDiff:
    name, needs_logits = "entropy-diff", True
    state_fields = ("prev",)

    def __init__(self, threshold: float = 1e-3) -> None:
        self.threshold = threshold

    def init(self, initial_latents: torch.Tensor) -> None:
        self.prev = torch.full((initial_latents.shape[0],), 100.0, device=initial_latents.device)

    def check(self, latents, logits):
        probs = F.softmax(logits.float(), dim=-1)
        entropy = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        values = (entropy - self.prev).abs()
        self.prev = entropy
        return values < self.threshold, values


class LatentDiff:
    name, needs_logits = "latent-diff", False
    state_fields = ("prev",)

    def __init__(self, threshold: float = 0.03) -> None:
        self.threshold = threshold

    def init(self, initial_latents: torch.Tensor) -> None:
        self.prev = initial_latents.clone()

    def check(self, latents, logits):
        values = ((latents - self.prev).norm(dim=-1) / latents.norm(dim=-1)).mean(dim=-1)
        self.prev = latents.clone()
        return values < self.threshold, values


class Cosine:
    name, needs_logits = "cosine", False
    state_fields = ("prev",)

    def __init__(self, threshold: float = 1e-3) -> None:
        self.threshold = threshold

    def init(self, initial_latents: torch.Tensor) -> None:
        self.prev = initial_latents.clone()

    def check(self, latents, logits):
        dot = (latents * self.prev).sum(dim=-1)
        cosine = dot / latents.norm(dim=-1) / self.prev.norm(dim=-1)
        values = 1 - cosine.mean(dim=1)
        self.prev = latents.clone()
        return values < self.threshold, values  # a zero initial state gives NaN: no exit


class KLDivergence:
    """KL(p_{t-1} ‖ p_t) of successive next-token distributions."""

    name, needs_logits = "kl", True
    state_fields = ("prev",)

    def __init__(self, vocab_size: int, threshold: float = 1e-3) -> None:
        self.vocab_size = vocab_size
        self.threshold = threshold

    def init(self, initial_latents: torch.Tensor) -> None:
        rows = initial_latents.shape[0]
        uniform = torch.full((rows, self.vocab_size), 1 / self.vocab_size)
        self.prev = uniform.to(initial_latents.device).log()

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits.float(), dim=-1)

    def check(self, latents, logits):
        log_probs = self.log_probs(logits)
        values = F.kl_div(log_probs, self.prev, reduction="none", log_target=True).sum(dim=-1)
        self.prev = log_probs
        return values < self.threshold, values


class MinPKLDivergence(KLDivergence):
    """KL over distributions where tokens under 0.1 x the top probability get 1/V, then
    renormalized."""

    name = "minp-kl"

    def __init__(self, vocab_size: int, threshold: float = 1e-5) -> None:
        super().__init__(vocab_size, threshold)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(logits.float(), dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < 0.1 * top, torch.full_like(probs, 1 / self.vocab_size), probs)
        return (probs / probs.sum(dim=-1, keepdim=True)).log()


class ArgmaxStability:
    name, needs_logits = "argmax-stability", True
    state_fields = ("prev", "stable")

    def __init__(self, threshold: float = 2) -> None:
        self.threshold = int(threshold)

    def init(self, initial_latents: torch.Tensor) -> None:
        rows, device = initial_latents.shape[0], initial_latents.device
        self.prev = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.stable = torch.zeros(rows, dtype=torch.long, device=device)

    def check(self, latents, logits):
        argmax = logits.argmax(dim=-1)
        self.stable = torch.where(argmax == self.prev, self.stable + 1, 0)
        self.prev = argmax
        return self.stable >= self.threshold, self.stable.float()


CRITERIA = ("none", "entropy-diff", "latent-diff", "cosine", "kl", "minp-kl", "argmax-stability")


def make_criterion(name: str, *, vocab_size: int, threshold: float | None = None) -> ExitCriterion:
    """A fresh criterion; `threshold` None takes the authors' default for it."""
    kwargs = {} if threshold is None else {"threshold": threshold}
    if name == "none":
        return NoExit()
    if name == "entropy-diff":
        return EntropyDiff(**kwargs)
    if name == "latent-diff":
        return LatentDiff(**kwargs)
    if name == "cosine":
        return Cosine(**kwargs)
    if name == "kl":
        return KLDivergence(vocab_size, **kwargs)
    if name == "minp-kl":
        return MinPKLDivergence(vocab_size, **kwargs)
    if name == "argmax-stability":
        return ArgmaxStability(**kwargs)
    raise ValueError(f"unknown exit criterion {name!r}; choose one of {', '.join(CRITERIA)}")
