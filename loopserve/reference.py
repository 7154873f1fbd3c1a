"""Dense reference generator: the oracle every batching test compares against.

One request, contiguous per-plane K/V, no paging, no batching, no scheduler — written for
obviousness, not speed. It shares only the model, the exit-policy functions and the sampler
with the engine, never the engine's KV or scheduling code.

Semantics (docs/architecture.md: depths, exit rules, KV layouts):
- the prompt runs at full depth; the first output token's loops are chosen by the exit
  policy over the D loop outputs of the last prompt position;
- each decode token loops until its policy exits, then the coda samples from that loop;
- LAST_EXITED: loop d reads and writes plane d; an early exit at depth e copies the token's
  depth-e K/V into planes e+1..D-1 (finalize);
- SHARED: one plane, every loop overwrites; prompts run position-major.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from loopserve.contracts import SampleSpec
from loopserve.errors import InvalidRequestError
from loopserve.exit import ExitMode, ExitRule, TokenExit, choose_exit_from_hazards
from loopserve.models.attention import DenseAttention, DenseKV
from loopserve.models.family import LoopedModel
from loopserve.models.kv_dtype import kv_storage_dtype
from loopserve.runner.logits_adjust import Matcher, TokenHistory
from loopserve.runner.sampler import make_generator, sample_rows
from loopserve.runner.transfers import Transfers
from loopserve.sampling_params import SamplingParams, StructuredOutput

LAYOUTS = ("last_exited", "shared")


class ReferenceOutput(NamedTuple):
    token_ids: list[int]
    exit_depths: list[int]  # loops used per output token (1..D)


def trace_loops_for(params: SamplingParams, token_index: int) -> int | None:
    """The trace entry of output token `token_index` (the trace repeats when exhausted)."""
    if params.exit_trace is None:
        return None
    return params.exit_trace[token_index % len(params.exit_trace)]


@torch.inference_mode()
def generate(
    model: LoopedModel,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    layout: str = "last_exited",
    exit_mode: str = "ouro",
    lookahead_seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    make_matcher: Callable[[StructuredOutput], Matcher] | None = None,
    loop_budgets: Sequence[int] | None = None,
    kv_cache_dtype: str = "auto",
) -> ReferenceOutput:
    """One request, densely. `make_matcher`: the grammar matchers of structured output (the
    tokenizer's `StructuredOutputs.matcher`), needed when `params` has one. `loop_budgets`:
    each decode token's max_loops (output tokens 1..; an engine's brownout recorded them,
    `Request.loop_budgets`) in place of the request's. `kv_cache_dtype`: every K/V is
    stored as an engine with that setting stores it (`models/kv_dtype.py`)."""
    if layout not in LAYOUTS:
        raise InvalidRequestError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    mode = ExitMode(exit_mode)
    if mode is ExitMode.TRACE and not params.exit_trace:
        raise InvalidRequestError("exit_mode 'trace' needs SamplingParams.exit_trace")
    if not prompt_token_ids:
        raise InvalidRequestError("prompt must contain at least one token")
    num_loops = model.num_loops
    params = params.resolve_loops(num_loops)
    rule = ExitRule(params.min_loops, params.max_loops, params.exit_threshold)
    hazard_fn = model.hazard_fn(lookahead_seed if mode is ExitMode.RANDOM_LOOKAHEAD else None)
    eos = set(model.config.eos_token_id if eos_token_ids is None else eos_token_ids)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    prompt = list(prompt_token_ids)
    shared = layout == "shared"
    run = _DenseRun(model, shared=shared, max_len=len(prompt) + params.max_tokens,
                    kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    device = run.device
    # Prompt at full depth; keep the last position's output of every loop.
    last_outputs = [loop[-1:] for loop in run.prompt(prompt)]
    hazards = None
    if mode.uses_gate:
        hazards = [float(hazard_fn(h)[0]) for h in last_outputs]
    loops = choose_exit_from_hazards(mode, rule, hazards, trace_loops_for(params, 0))

    spec = SampleSpec.of(params, stop_ids)
    generator = make_generator(params.seed, device) if not params.greedy else None
    token_ids: list[int] = []
    exit_depths: list[int] = []
    history = None
    if spec.adjusts_logits:
        vocab_size = model.config.vocab_size
        matcher = None
        if spec.structured is not None:
            if make_matcher is None:
                raise InvalidRequestError("structured output needs make_matcher")
            matcher = make_matcher(spec.structured)
        history = TokenHistory(
            spec, vocab_size, Transfers(device), prompt_token_ids=prompt, matcher=matcher
        )

    def emit(exit_hidden: torch.Tensor, loops_used: int) -> bool:
        logits = model.leave(exit_hidden)
        token = sample_rows(logits, [spec], [generator], histories=[history])[0].token_id
        if history is not None:
            history.record(token)
        token_ids.append(token)
        exit_depths.append(loops_used)
        return token in stop_ids or len(token_ids) >= params.max_tokens

    done = emit(last_outputs[loops - 1], loops)
    while not done:
        position = len(prompt) + len(token_ids) - 1
        pos = torch.tensor([position], device=device)
        hidden = model.enter(torch.tensor([token_ids[-1]], device=device))
        token_rule = rule
        if loop_budgets is not None:
            budget = loop_budgets[len(token_ids) - 1]
            token_rule = ExitRule(rule.min_loops, budget, rule.threshold)
        token_exit = TokenExit(mode, token_rule, trace_loops_for(params, len(token_ids)))
        while True:
            hidden = run.loop(hidden, pos, token_exit.depth)
            needs_gate = token_exit.plan().needs_gate
            if token_exit.observe(float(hazard_fn(hidden)[0]) if needs_gate else None):
                break
        exit_depth = token_exit.depth - 1
        if not shared:
            for plane in range(exit_depth + 1, num_loops):
                run.kv.copy_position(exit_depth, plane, position)
        done = emit(hidden, token_exit.loops_used)
    return ReferenceOutput(token_ids, exit_depths)


class _DenseRun:
    """One request's contiguous per-plane K/V and its loop runner (`generate` and
    `prompt_logprobs` run the prompt the same way)."""

    def __init__(
        self, model: LoopedModel, *, shared: bool, max_len: int, kv_cache_dtype: str = "auto"
    ) -> None:
        config = model.config
        self.model, self.shared, self.num_loops = model, shared, model.num_loops
        self.device = model.lm_head.weight.device
        self.kv = DenseKV(
            num_planes=1 if shared else model.num_loops,
            num_layers=model.kv_layers,
            max_len=max_len,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=model.lm_head.weight.dtype,
            device=self.device,
            storage_dtype=kv_storage_dtype(kv_cache_dtype, model.lm_head.weight.dtype),
        )
        self.scale = config.head_dim**-0.5

    def loop(self, hidden: torch.Tensor, positions: torch.Tensor, depth: int) -> torch.Tensor:
        plane = 0 if self.shared else depth
        attention = DenseAttention(self.kv, plane, positions, self.scale)
        return self.model.loop(hidden, positions, attention)

    def prompt(self, prompt: list[int]) -> list[torch.Tensor]:
        """Run the prompt at full depth (SHARED: position-major); returns every loop's output
        [len, hidden] of every position."""
        model, device = self.model, self.device
        if self.shared:
            per_position = []
            for position, token in enumerate(prompt):
                hidden = model.enter(torch.tensor([token], device=device))
                pos = torch.tensor([position], device=device)
                outputs = []
                for depth in range(self.num_loops):
                    hidden = self.loop(hidden, pos, depth)
                    outputs.append(hidden)
                per_position.append(outputs)
            return [torch.cat(loop) for loop in zip(*per_position)]
        positions = torch.arange(len(prompt), device=device)
        hidden = model.enter(torch.tensor(prompt, device=device))
        loop_outputs = []
        for depth in range(self.num_loops):
            hidden = self.loop(hidden, positions, depth)
            loop_outputs.append(hidden)
        return loop_outputs


@torch.inference_mode()
def prompt_logprob_rows(
    model: LoopedModel,
    prompt_token_ids: Sequence[int],
    *,
    layout: str = "last_exited",
    exit_rule: ExitRule | None = None,
) -> torch.Tensor:
    """Next-token log-probabilities [len - 1, vocab] at every prompt position but the last,
    from the last loop's output (the prompt at full depth, as `generate` runs it), or with
    `exit_rule` from the loop that rule picks per position over the trained gate's hazards
    (`SamplingParams.prompt_logprobs_loop = "exit"`)."""
    loop_outputs = _prompt_loop_outputs(model, prompt_token_ids, layout)
    scored = loop_outputs[-1]
    if exit_rule is not None:
        loops = _exit_loops(model, loop_outputs, exit_rule)
        scored = torch.stack([loop_outputs[loop - 1][p] for p, loop in enumerate(loops)])
    return torch.log_softmax(model.leave(scored).float(), dim=-1)


@torch.inference_mode()
def prompt_exit_loops(
    model: LoopedModel,
    prompt_token_ids: Sequence[int],
    exit_rule: ExitRule,
    *,
    layout: str = "last_exited",
) -> list[int]:
    """The loop `exit_rule` picks for every prompt position but the last (what scores it
    with `prompt_logprobs_loop = "exit"`)."""
    return _exit_loops(model, _prompt_loop_outputs(model, prompt_token_ids, layout), exit_rule)


def _prompt_loop_outputs(model, prompt_token_ids, layout: str) -> list[torch.Tensor]:
    """Every loop's output at every prompt position but the last (full depth)."""
    if layout not in LAYOUTS:
        raise InvalidRequestError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    prompt = list(prompt_token_ids)
    run = _DenseRun(model, shared=layout == "shared", max_len=len(prompt))
    return [output[:-1] for output in run.prompt(prompt)]


def _exit_loops(model, loop_outputs: list[torch.Tensor], exit_rule: ExitRule) -> list[int]:
    hazard_fn = model.hazard_fn(None)
    hazards = [hazard_fn(output).float().tolist() for output in loop_outputs]
    return [
        choose_exit_from_hazards(ExitMode.OURO, exit_rule, list(column)) for column in zip(*hazards)
    ]


def prompt_logprobs(
    model: LoopedModel,
    prompt_token_ids: Sequence[int],
    *,
    layout: str = "last_exited",
    exit_rule: ExitRule | None = None,
) -> list[float | None]:
    """Log-probability of each prompt token given the ones before it (`prompt_logprob_rows`);
    None for the first token."""
    prompt = list(prompt_token_ids)
    rows = prompt_logprob_rows(model, prompt, layout=layout, exit_rule=exit_rule)
    chosen = rows.gather(1, torch.tensor(prompt[1:], device=rows.device)[:, None])[:, 0]
    return [None, *chosen.tolist()]
