"""Dense K/V and the reference generator for Huginn: the oracle the batched paths answer to.

`HuginnDenseKV` keeps one request's K/V the way the authors' cache does: one entry per
(prelude layer, position), (core layer, recurrence step, position) and (coda layer,
position). When a past position exited before step t, two lookups exist:

- `full` (the authors' default `lookup_strategy`): that position is invisible to step t;
- `last_exited` (the authors' `latest-m4`, loopserve's LAST_EXITED layout): step t reads
  that position's last step, for the same core layer;
- `always_last` (the authors' `always-last-m4`): when every position ran step t, step t;
  otherwise every position at the last step it ran, whatever the current step;
- `shared` (loopserve's SHARED layout: one entry per position, overwritten by each step):
  every position at the last step it ran so far (the current call's rows at this step).

Both are exact only for one request: with adaptive compute, the authors' batched cache holds
entries every row of the batch computed, so tokens see states they would not have alone.

`generate` follows the authors' `generate_with_adaptive_compute` (criterion `none` with a
step count is their fixed-depth `generate_minimal`): each step of generation runs the prelude
over its positions, draws the initial state, iterates the core, checks the criterion after
every step from `min_steps` on, and reads logits from the coda at the exit step. The first
such step is the whole prompt, which under the authors' semantics exits as one token
(`exit_in_prompt=True`); loopserve's default runs the prompt at full depth
(`exit_in_prompt=False`, the authors' `do_not_exit_in_prefill=True`). Greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.exit.criteria import ExitCriterion, make_criterion
from loopserve.models.attention import attention_reference
from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.models.kv_dtype import kv_storage_dtype, round_trip

LOOKUPS = ("full", "last_exited", "always_last", "shared")


class HuginnDenseKV:
    def __init__(
        self,
        model: HuginnForLoopedLM,
        *,
        max_len: int,
        max_steps: int,
        lookup: str = "full",
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`kv_cache_dtype`: each written K/V is rounded as an engine with that setting
        stores it (`models/kv_dtype.py`)."""
        if lookup not in LOOKUPS:
            raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
        config = model.config
        param = model.lm_head.weight
        heads, dim = config.num_key_value_heads, config.head_dim
        kw = {"dtype": param.dtype, "device": param.device}
        self.storage_dtype = kv_storage_dtype(kv_cache_dtype, param.dtype)
        self.groups = config.layer_groups
        self.lookup = lookup
        self.once_k = torch.zeros(config.num_once_layers, max_len, heads, dim, **kw)
        self.once_v = torch.zeros_like(self.once_k)
        self.core_k = torch.zeros(max_steps, config.num_core_layers, max_len, heads, dim, **kw)
        self.core_v = torch.zeros_like(self.core_k)
        self.present = torch.zeros(max_steps, max_len, dtype=torch.bool, device=param.device)
        self.scale = dim**-0.5

    def _once_index(self, layer_idx: int) -> int:
        prelude = self.groups["prelude"]
        if layer_idx in prelude:
            return layer_idx
        return len(prelude) + self.groups["coda"].index(layer_idx)

    def attention(self, positions: torch.Tensor, step: int | None) -> HuginnDenseAttention:
        """A backend for one call over `positions`; `step` is the recurrence step of its core
        layers (None for a prelude or coda call)."""
        return HuginnDenseAttention(self, positions, step)


class HuginnDenseAttention:
    def __init__(self, kv: HuginnDenseKV, positions: torch.Tensor, step: int | None) -> None:
        self.kv, self.positions, self.step = kv, positions, step
        self.context_len = int(positions.max().item()) + 1
        span = torch.arange(self.context_len, device=positions.device)
        self.causal = span.unsqueeze(0) <= positions.unsqueeze(1)  # [rows, context]

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        kv, pos, n = self.kv, self.positions, self.context_len
        key, value = round_trip(key, kv.storage_dtype), round_trip(value, kv.storage_dtype)
        if layer_idx not in kv.groups["core"]:
            slot = kv._once_index(layer_idx)
            kv.once_k[slot, pos], kv.once_v[slot, pos] = key, value
            keys, values = kv.once_k[slot, :n], kv.once_v[slot, :n]
            return attention_reference(query, keys, values, self.causal, kv.scale)
        if self.step is None:
            raise ValueError("a core layer ran in a call without a recurrence step")
        layer, step = kv.groups["core"].index(layer_idx), self.step
        kv.core_k[step, layer, pos], kv.core_v[step, layer, pos] = key, value
        kv.present[step, pos] = True
        if kv.lookup == "full":
            keys, values = kv.core_k[step, layer, :n], kv.core_v[step, layer, :n]
            allowed = self.causal & kv.present[step, :n].unsqueeze(0)
            return attention_reference(query, keys, values, allowed, kv.scale)
        # last_exited: each position's last step <= this one (every position ran step 0);
        # shared, and always_last unless every position ran this step: its last step of all.
        bound = step + 1
        if kv.lookup == "shared" or (
            kv.lookup == "always_last" and not bool(kv.present[step, :n].all())
        ):
            bound = kv.present.shape[0]
        steps = torch.arange(bound, device=pos.device).unsqueeze(1)
        last = (kv.present[:bound, :n] * steps).amax(dim=0)  # [n]
        span = torch.arange(n, device=pos.device)
        keys, values = kv.core_k[last, layer, span], kv.core_v[last, layer, span]
        return attention_reference(query, keys, values, self.causal, kv.scale)


@dataclass
class HuginnGeneration:
    tokens: list[int]
    steps: list[int]  # recurrence steps of each generation step (prompt first)
    logits: list[torch.Tensor]  # [vocab] float32 of each generated token
    exit_values: list[list[float]]  # the criterion's value at every check of each step


def _run_token(
    model: HuginnForLoopedLM,
    kv: HuginnDenseKV,
    token_ids: list[int],
    start: int,
    *,
    max_steps: int,
    min_steps: int,
    criterion: ExitCriterion,
    may_exit: bool,
    init_scale: float,
    generator: torch.Generator | None,
    initial: torch.Tensor | None = None,
    delayed: bool = False,
) -> tuple[torch.Tensor, int, list[float]]:
    """One generation step over positions start.. (one token, or the whole prompt). Returns
    the logits of every position [S, vocab] at the exit step, the steps used and the
    criterion's value at every check. `delayed`: loopserve's `criterion_delayed` (a check
    that fires after step t exits after step t+1, which is not checked)."""
    device = model.lm_head.weight.device
    ids = torch.tensor(token_ids, device=device)
    pos = torch.arange(start, start + len(token_ids), device=device)
    e = model.prelude(ids, pos, kv.attention(pos, None))
    state = (
        model.initial_state(e, init_scale=init_scale, generator=generator)
        if initial is None
        else initial
    )
    criterion.init(state.unsqueeze(0))
    logits, checked, exit_after = None, [], None
    for step in range(max_steps):
        state = model.core(state, e, pos, kv.attention(pos, step))
        logits = None
        if step == exit_after:
            return model.coda(state, pos, kv.attention(pos, None)), step + 1, checked
        if step < min_steps or not may_exit:
            continue
        if criterion.needs_logits:
            logits = model.coda(state, pos, kv.attention(pos, None))
        exits, values = criterion.check(state.unsqueeze(0), None if logits is None else logits[-1:])
        checked.append(float(values[0]))
        if bool(exits[0]) and delayed:
            exit_after = step + 1
        elif bool(exits[0]):
            if logits is None:
                logits = model.coda(state, pos, kv.attention(pos, None))
            return logits, step + 1, checked
    if logits is None:
        logits = model.coda(state, pos, kv.attention(pos, None))
    return logits, max_steps, checked


@torch.no_grad()
def generate(
    model: HuginnForLoopedLM,
    prompt: list[int],
    *,
    max_new_tokens: int,
    num_steps: int | None = None,
    criterion: str = "none",
    threshold: float | None = None,
    min_steps: int = 0,
    lookup: str = "full",
    exit_in_prompt: bool = True,
    init_scale: float = 0.0,
    latent_seed: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
    prompt_by_position: bool = False,
    delayed: bool = False,
    kv_cache_dtype: str = "auto",
) -> HuginnGeneration:
    """`prompt_by_position`: run the prompt one position at a time, each through all its
    steps before the next starts (loopserve's SHARED layout runs prompts that way); the
    initial states are still drawn as one block for the whole prompt. `delayed`: tokens exit
    one step after their criterion fires (loopserve's `criterion_delayed`). `kv_cache_dtype`:
    K/V stored as an engine with that setting stores it."""
    max_steps = num_steps or model.config.mean_recurrence
    kv = HuginnDenseKV(model, max_len=len(prompt) + max_new_tokens, max_steps=max_steps,
                       lookup=lookup, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    rule = make_criterion(criterion, vocab_size=model.config.vocab_size, threshold=threshold)
    generator = None if latent_seed is None else torch.Generator().manual_seed(latent_seed)
    kwargs = {"max_steps": max_steps, "min_steps": min_steps, "criterion": rule,
              "init_scale": init_scale, "generator": generator, "delayed": delayed}  # fmt: skip
    out = HuginnGeneration([], [], [], [])
    chunk, start = list(prompt), 0
    if prompt_by_position:
        block = None
        if init_scale > 0:
            width = model.config.n_embd
            blank = torch.empty(len(prompt), width, dtype=model.lm_head.weight.dtype)
            block = model.initial_state(blank, init_scale=init_scale, generator=generator)
            block = block.to(model.lm_head.weight.device)
        for i in range(len(prompt)):
            initial = None if block is None else block[i : i + 1]
            kwargs_i = {**kwargs, "initial": initial}
            if i < len(prompt) - 1:
                _run_token(model, kv, [prompt[i]], i, may_exit=False, **kwargs_i)
        chunk, start = [prompt[-1]], len(prompt) - 1
        kwargs["initial_last"] = None if block is None else block[-1:]
    for index in range(max_new_tokens):
        may_exit = exit_in_prompt or index > 0
        first = kwargs.pop("initial_last", None) if index == 0 else None
        logits, steps, checked = _run_token(
            model, kv, chunk, start, may_exit=may_exit, initial=first, **kwargs
        )
        token = int(logits[-1].argmax())
        out.tokens.append(token)
        out.steps.append(steps)
        out.logits.append(logits[-1])
        out.exit_values.append(checked)
        if token in eos_token_ids:
            break
        start += len(chunk)
        chunk = [token]
    return out


@torch.no_grad()
def teacher_forced_logits(
    model: HuginnForLoopedLM, token_ids: list[int], *, num_steps: int | None = None
) -> torch.Tensor:
    """Logits [S, vocab] of every position at a fixed step count, zero initial state (the
    authors' `model(input_ids, num_steps=r, init_scale=0)`)."""
    steps = num_steps or model.config.mean_recurrence
    kv = HuginnDenseKV(model, max_len=len(token_ids), max_steps=steps)
    logits, _, _ = _run_token(model, kv, list(token_ids), 0, max_steps=steps, min_steps=0,
                           criterion=make_criterion("none", vocab_size=1), may_exit=False,
                           init_scale=0.0, generator=None)  # fmt: skip
    return logits


@torch.no_grad()
def step_logits(
    model: HuginnForLoopedLM, token_ids: list[int], *, num_steps: int | None = None
) -> list[torch.Tensor]:
    """`teacher_forced_logits` after every step 1..r of one run: [S, vocab] per step (a
    step's state depends only on the steps before it, so step s's logits equal a run of s
    steps)."""
    steps = num_steps or model.config.mean_recurrence
    kv = HuginnDenseKV(model, max_len=len(token_ids), max_steps=steps)
    device = model.lm_head.weight.device
    ids = torch.tensor(list(token_ids), device=device)
    pos = torch.arange(len(token_ids), device=device)
    e = model.prelude(ids, pos, kv.attention(pos, None))
    state = model.initial_state(e, init_scale=0.0)
    logits = []
    for step in range(steps):
        state = model.core(state, e, pos, kv.attention(pos, step))
        logits.append(model.coda(state, pos, kv.attention(pos, None)))
    return logits


@torch.no_grad()
def score_tokens(
    model: HuginnForLoopedLM,
    token_ids: list[int],
    *,
    criterion: str = "none",
    threshold: float | None = None,
    min_steps: int = 0,
    num_steps: int | None = None,
    steps: list[int] | None = None,
    lookup: str = "last_exited",
) -> tuple[torch.Tensor, list[int]]:
    """Teacher forcing one position at a time, each exiting by `criterion` (the authors'
    `_prefill_with_varied_exit_steps`), or after `steps[i]` steps when given (a control).
    Returns the log-probability of every next token [len - 1] and the steps each used."""
    max_steps = num_steps or model.config.mean_recurrence
    kv = HuginnDenseKV(model, max_len=len(token_ids), max_steps=max_steps, lookup=lookup)
    vocab = model.config.vocab_size
    logprobs, used = [], []
    for i in range(len(token_ids) - 1):
        fixed = steps is not None
        rule = make_criterion("none" if fixed else criterion, vocab_size=vocab,
                              threshold=threshold)  # fmt: skip
        logits, count, _ = _run_token(
            model, kv, [token_ids[i]], i, max_steps=steps[i] if fixed else max_steps,
            min_steps=min_steps, criterion=rule, may_exit=True, init_scale=0.0, generator=None,
        )  # fmt: skip
        logprobs.append(torch.log_softmax(logits[-1].float(), dim=-1)[token_ids[i + 1]])
        used.append(count)
    return torch.stack(logprobs), used


@torch.no_grad()
def prompt_logprobs_at_exit(
    model: HuginnForLoopedLM,
    token_ids: list[int],
    *,
    criterion: str,
    threshold: float | None = None,
    min_steps: int = 0,
    num_steps: int | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[torch.Tensor, list[int]]:
    """loopserve's prompt logprobs at the exit loop (`prompt_logprobs_loop='exit'`): the
    prompt runs all `num_steps` steps (zero initial state); each position is then scored
    as a decode token there would exit: `criterion`, checked from step `min_steps` on over
    the position's state after each step, from its initial state, with the coda of that
    step attending to the earlier positions' coda K/V of the last step and to its own of
    that step. Returns the log-probability of every next token [len - 1] and the steps
    each position's score used. `kv_cache_dtype`: K/V stored as an engine with that setting
    stores it."""
    steps = num_steps or model.config.mean_recurrence
    device = model.lm_head.weight.device
    n = len(token_ids)
    kv = HuginnDenseKV(model, max_len=n, max_steps=steps, lookup="last_exited",
                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    ids = torch.tensor(token_ids, device=device)
    pos = torch.arange(n, device=device)
    e = model.prelude(ids, pos, kv.attention(pos, None))
    states = [model.initial_state(e, init_scale=0.0)]
    for step in range(steps):
        states.append(model.core(states[-1], e, pos, kv.attention(pos, step)))
    model.coda(states[-1], pos, kv.attention(pos, None))  # the last step's coda K/V
    final_k, final_v = kv.once_k.clone(), kv.once_v.clone()
    vocab = model.config.vocab_size
    logprobs, used = [], []
    for i in range(n - 1):
        rule = make_criterion(criterion, vocab_size=vocab, threshold=threshold)
        rule.init(states[0][i : i + 1].unsqueeze(0))
        here = pos[i : i + 1]
        for step in range(steps):
            logits = None
            last = step == steps - 1
            if step >= min_steps and not last:
                if rule.needs_logits:
                    logits = model.coda(states[step + 1][i : i + 1], here, kv.attention(here, None))
                fired, _ = rule.check(states[step + 1][i : i + 1].unsqueeze(0), logits)
                if not bool(fired[0]):
                    continue
            elif not last:
                continue
            if logits is None:
                logits = model.coda(states[step + 1][i : i + 1], here, kv.attention(here, None))
            logprobs.append(torch.log_softmax(logits[-1].float(), dim=-1)[token_ids[i + 1]])
            used.append(step + 1)
            break
        kv.once_k.copy_(final_k)  # the coda above wrote this position's K/V of its steps
        kv.once_v.copy_(final_v)
    return torch.stack(logprobs), used
