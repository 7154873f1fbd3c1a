"""The Huginn executor: continuous depth batching for a model with a prelude and a coda of
attention layers, input injection at every step, and convergence exit criteria.

It executes the same `SchedulerOutput` as `ModelRunner` (decode rows as columns, prompt and
replay items, refill and no_refill, every prompt arm) with eager calls on a paged attention
backend (torch, or the Triton kernels on CUDA). Rows of different requests at different recurrence steps share each core
call. What is particular to the family:

- K/V: every request holds the layout's planes for the core layers (one per step under
  LAST_EXITED) plus one more, the *once plane* (the last of its block tables), whose layers
  hold the prelude's and the coda's K/V, one entry per position. The cache tensor has
  max(core, prelude + coda) layers; `_Router` sends each global layer index to the plane
  and local layer it uses.
- A row carries two vectors between steps: its state and `e`, the prelude's output that
  every step injects.
- Exits: the request's criterion (`exit/criteria.py`) is checked after every loop the
  scheduler plans as GATE (loops from `min_loops` on) and reported as a hazard of 1 (it
  fired) or 0, so the scheduler's CDF rule exits exactly when the criterion fires (any
  threshold in (0, 1]); rows before `min_loops` report 0 and their criterion state stays
  as it was at the token's start, as in the authors' code. Criteria that read the
  next-token distribution run the coda (writing the position's coda K/V, overwritten by
  each check) at every checked loop.
- Prompts run at full depth and their first token uses all of the request's loops
  (`max_loops`, its r; the authors' `do_not_exit_in_prefill=True`): the state of every
  prompt row at the request's last loop is kept, and at the chunk's last depth the coda
  runs over all its rows from those states, so later tokens find every position's coda
  K/V as a run at r steps leaves it.
- The initial state: zeros (`init_scale=0`), or the authors' random state (`init_scale` >
  0) drawn from a generator seeded with the request's seed in their order: the whole
  prompt's block at once, then one row per generated token; draws are kept per position
  so recompute after preemption and chunked prompts reuse them.

With `prompt_exits` (the authors' prompt semantics): a request's whole prompt, one atomic
chunk, exits as one token: after every loop from `min_loops` on the criterion reads the
prompt's states (latent criteria average over its positions) or its last position's
next-token distribution, and at the loop it fires the prompt stops, its K/V of that loop is
copied into every deeper plane (LAST_EXITED, the authors' `latest-m4`), its coda runs over
all positions, and the first token is sampled with those loops.

Under the SHARED layout a request holds one step plane (overwritten by every step) and the
once plane: a later token reads each past position at the last step it ran (the dense
reference's `shared` lookup; the authors' `always-last-m4` differs only while every
position ran the current step).

Not supported (start-up errors in `LLMEngine`): CUDA graphs, prompt log-probabilities,
batch-invariant mode, PD hand-off.
"""

from __future__ import annotations

import logging
import random
import time

import numpy as np
import torch

from loopserve.contracts import (
    DecodeResults,
    ItemKind,
    ItemResult,
    KVTransfer,
    NewRequestData,
    RequestFailure,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
    SwapKind,
    WorkItem,
)
from loopserve.errors import ConfigError, InvalidRequestError
from loopserve.execution import Executor, StepRules, run_without_failed
from loopserve.exit import ExitMode, choose_exit_from_hazards
from loopserve.exit.columns import GATE, decide_exits
from loopserve.exit.criteria import ExitCriterion, make_criterion
from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.runner.attention.base import RowSegment, finalize_slots
from loopserve.runner.attention.registry import make_attention_backend, resolve_attention_backend
from loopserve.runner.handles import HandleTable
from loopserve.runner.sampler import TokenHistory, is_greedy, make_generator, sample_rows
from loopserve.runner.swap import SwapSpace
from loopserve.runner.transfers import Transfers

logger = logging.getLogger(__name__)


def check_huginn_config(config) -> None:
    """Start-up errors for the engine options the Huginn executor does not run (an
    `EngineConfig`; CPU, eager, LAST_EXITED, recompute preemption, the `ouro` exit mode)."""
    graph = config.graph_mode if not config.enforce_eager else "off"
    problems = []
    if graph not in ("off", "auto") or (graph == "auto" and config.device.startswith("cuda")):
        problems.append(f"graph_mode={config.graph_mode!r} (Huginn runs eagerly: graph_mode='off')")
    if config.exit.mode != "ouro":
        problems.append(f"exit_mode={config.exit.mode!r} (Huginn exits by its criterion: 'ouro')")
    if config.batch_invariant:
        problems.append("batch_invariant=True")
    if config.async_scheduling:
        problems.append("async_scheduling=True")
    if config.exit.lookup == "full":
        if config.cache.layout != "last_exited":
            problems.append("kv_lookup='full' outside layout='last_exited'")
        backend = resolve_attention_backend(config.attention_backend, config.device)
        if backend != "torch":
            problems.append(f"kv_lookup='full' on the {backend} attention backend (torch only)")
    if config.exit.prompt_exits:
        if config.scheduler.prefill_mode != "atomic" or config.scheduler.mixed_prefill_decode:
            problems.append("prompt_exits=True outside prefill_mode='atomic' without mixing")
        if config.cache.enable_prefix_caching is not False:
            problems.append("prompt_exits=True with prefix caching (pass it off)")
    if problems:
        raise ConfigError("Huginn-0125 does not run with " + "; ".join(problems))


class _Router:
    """The attention backend a Huginn call hands the model: core layers go to the rows'
    step planes, prelude and coda layers to their once plane."""

    def __init__(self, groups: dict[str, range], core=None, once=None) -> None:
        self.core, self.once = core, once
        self.core_start = groups["core"].start
        self.core_layers = groups["core"]
        prelude, coda = groups["prelude"], groups["coda"]
        self.once_index = {layer: i for i, layer in enumerate([*prelude, *coda])}

    def attend(self, layer_idx: int, query, key, value):
        if layer_idx in self.core_layers:
            return self.core.attend(layer_idx - self.core_start, query, key, value)
        return self.once.attend(self.once_index[layer_idx], query, key, value)


class _Token:
    """A decode token in flight: its state, its injected prelude output and its criterion
    state (one tensor per `state_fields` entry, without the token dimension)."""

    __slots__ = ("state", "e", "criterion")

    def __init__(self, state: torch.Tensor, e: torch.Tensor, criterion: list[torch.Tensor]):
        self.state, self.e, self.criterion = state, e, criterion


class _Latents:
    """A request's random initial states: its generator, the prompt's block (drawn whole at
    the first chunk) and each generated position's row."""

    __slots__ = ("generator", "prompt_len", "prompt", "drawn")

    def __init__(self, generator: torch.Generator, prompt_len: int) -> None:
        self.generator, self.prompt_len = generator, prompt_len
        self.prompt: torch.Tensor | None = None
        self.drawn: dict[int, torch.Tensor] = {}


class HuginnRunner(Executor):
    def __init__(
        self,
        model: HuginnForLoopedLM,
        *,
        num_blocks: int,
        block_size: int,
        layout: str,
        criterion: str,
        criterion_threshold: float | None = None,
        init_scale: float = 0.0,
        prompt_exits: bool = False,
        num_host_blocks: int = 0,
        attention_backend: str = "torch",
        lookup: str = "last_exited",
        make_matcher=None,
    ) -> None:
        """`attention_backend`: a name of `runner.attention.registry` (the Triton kernels on
        CUDA; the same calls, eagerly, as for the torch path)."""
        config = model.config
        self.model = model
        self.num_loops = model.num_loops
        self.block_size = block_size
        self.rules = StepRules.of(layout, self.num_loops)
        self.once_plane = self.rules.num_planes  # the extra plane after the step planes
        self.groups = config.layer_groups
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        layers = max(config.num_core_layers, config.num_once_layers)
        self.kv_cache = torch.zeros(
            (layers, 2, num_blocks * block_size, config.num_key_value_heads, config.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.transfers = Transfers(self.device)
        # Swap preemption: blocks of every plane (the once plane too) go to host memory; the
        # request's paused work waits here, on the device, until it swaps back in.
        self.swap = SwapSpace(self.kv_cache, num_host_blocks, block_size)
        self.swapped: dict[str, tuple[dict, _Token | None]] = {}
        self.attention = make_attention_backend(
            attention_backend, self.kv_cache, block_size=block_size,
            scale=config.head_dim**-0.5, transfers=self.transfers,
        )  # fmt: skip
        self.vocab_size = config.vocab_size
        self.criterion_name = criterion
        self.criterion_threshold = criterion_threshold
        make_criterion(criterion, vocab_size=config.vocab_size, threshold=criterion_threshold)
        self.init_scale = init_scale
        self.prompt_exits = prompt_exits
        self.make_matcher = make_matcher  # a fresh grammar matcher (structured output)
        # lookup "full" (the authors' default): no finalize copies; a one-row item at step t
        # does not attend to earlier positions that ran t steps or fewer (`steps_run`).
        self.full = lookup == "full"
        self.steps_run: dict[str, dict[int, int]] = {}  # request -> position -> steps
        self.latents: dict[str, _Latents] = {}  # with init_scale > 0
        self.samplers: dict[str, tuple] = {}
        self.max_loops: dict[str, int] = {}  # per request: its r
        self.decoding: dict[str, _Token] = {}
        # Prompt and replay work between steps: (state, e, state at the request's last loop).
        self.inflight: HandleTable[tuple] = HandleTable()
        self._forward_s = 0.0

    def _criterion(self) -> ExitCriterion:
        return make_criterion(
            self.criterion_name, vocab_size=self.vocab_size, threshold=self.criterion_threshold
        )

    # ---- bookkeeping -------------------------------------------------------------------

    def setup_request(self, new: NewRequestData) -> tuple:
        if self.rules.shared and 0 < new.max_loops < self.num_loops:
            raise InvalidRequestError(
                "under the shared layout a Huginn request runs the model's r steps "
                f"({self.num_loops}); max_loops below it needs the last_exited layout"
            )
        generator = None if is_greedy(new.sample_spec) else make_generator(new.seed, self.device)
        history = None
        if new.sample_spec.adjusts_logits:
            matcher = None
            if new.sample_spec.structured is not None:
                if self.make_matcher is None:
                    raise InvalidRequestError("structured output needs the model's tokenizer")
                matcher = self.make_matcher(new.sample_spec.structured)
            history = TokenHistory(
                new.sample_spec, self.vocab_size, self.transfers,
                prompt_token_ids=new.prompt_token_ids, output_token_ids=new.output_token_ids,
                matcher=matcher,
            )  # fmt: skip
        return new.sample_spec, generator, history

    def _drop(self, request_id: str) -> None:
        self.samplers.pop(request_id, None)
        self.max_loops.pop(request_id, None)
        self.latents.pop(request_id, None)
        self.steps_run.pop(request_id, None)
        self.swapped.pop(request_id, None)
        self.decoding.pop(request_id, None)
        self.inflight.release(request_id)

    def _bookkeeping(self, scheduled: SchedulerOutput) -> tuple[RequestFailure, ...]:
        for request_id in scheduled.finished_request_ids:
            self._drop(request_id)
        failures = []
        for new in scheduled.new_requests:
            try:
                self.samplers[new.request_id] = self.setup_request(new)
                self.max_loops[new.request_id] = new.max_loops or self.num_loops
                if self.init_scale > 0:
                    seed = new.seed if new.seed is not None else random.getrandbits(63)
                    generator = torch.Generator().manual_seed(seed)
                    self.latents[new.request_id] = _Latents(generator, new.prompt_len)
            except Exception as err:  # fails this request only
                logger.exception("setup of request %s failed", new.request_id)
                self._drop(new.request_id)
                failures.append(RequestFailure(new.request_id, f"{type(err).__name__}: {err}"))
        for transfer in scheduled.kv_transfers:  # in order, before the step's calls
            self._move(transfer)
        for request_id in scheduled.preempted_request_ids:
            self.inflight.release(request_id)
            self.decoding.pop(request_id, None)
        return tuple(failures)

    def _move(self, transfer: KVTransfer) -> None:
        assert transfer.kind is not SwapKind.IMPORT, "Huginn requests are not handed off"
        self.swap.copy(transfer)
        request_id = transfer.request_id
        if transfer.kind is SwapKind.OUT:
            handles = [h for h in self.inflight.handles_of(request_id) if h in self.inflight]
            states = {h: self.inflight.resume(h) for h in handles}
            self.inflight.release(request_id)
            self.swapped[request_id] = (states, self.decoding.pop(request_id, None))
            return
        states, token = self.swapped.pop(request_id)
        for handle, state in states.items():
            self.inflight.keep(request_id, handle, state)
        if token is not None:
            self.decoding[request_id] = token

    @property
    def num_live_handles(self) -> int:
        return len(self.inflight) + len(self.decoding)

    # ---- execution ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        failures = self._bookkeeping(scheduled)
        reasons = {}
        for item in scheduled.items:
            if item.score_rule is not None:
                reasons[item.request_id] = (
                    "prompt logprobs at the exit loop are not supported for Huginn yet "
                    "(prompt_logprobs_loop='last' is)"
                )
            elif (
                self.prompt_exits
                and item.kind is ItemKind.PROMPT
                and (item.token_start > 0 or not item.first_token)
            ):
                reasons[item.request_id] = (
                    "with prompt_exits the whole prompt must be one chunk: raise "
                    "prefill_chunk_size and max_num_batched_tokens above its length"
                )
        for failure in failures:
            reasons.pop(failure.request_id, None)
        if reasons:  # fails those requests alone, with the reason
            for request_id in reasons:
                self._drop(request_id)
            failures += tuple(
                RequestFailure(rid, f"InvalidRequestError: {reasons[rid]}")
                for rid in sorted(reasons)
            )
        if failures:
            return run_without_failed(scheduled, failures, self._run)
        return self._run(scheduled)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self._forward_s += time.perf_counter() - start
        return out

    def _run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        if scheduled.is_empty:
            return RunnerOutput(scheduled.step_id, ())
        start_s, self._forward_s = time.perf_counter(), 0.0
        items, tables, decode = scheduled.items, scheduled.block_tables, scheduled.decode
        num_calls = max([item.num_depths for item in items] + [1])
        states: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
        # Prompt rows' states at their request's last loop (None until it ran).
        loop_states: list[torch.Tensor | None] = [None] * len(items)
        exited_items = [False] * len(items)
        rows_per_call = []
        decode_out = None
        num_finalized = 0
        # Prompt exits: item -> its criterion while it runs, then (loops used, logits).
        self._prompt_rules: dict[int, ExitCriterion] = {}
        self._prompt_exited: dict[int, tuple[int, torch.Tensor]] = {}
        for k in range(num_calls):
            active = [
                i
                for i, item in enumerate(items)
                if k < item.num_depths and i not in self._prompt_exited
            ]
            rows = decode if (k == 0 and decode is not None) else None
            if not active and rows is None:
                break
            out = self._call(k, rows, items, active, tables, states, loop_states)
            if self.prompt_exits:
                num_finalized += self._prompt_checks(k, items, active, tables, states)
            rows_per_call.append(
                sum(items[i].token_count for i in active) + (0 if rows is None else len(rows))
            )
            if rows is not None:
                decode_out = out
            num_finalized += self._replays(k, items, active, tables, states, exited_items)
        failed: list[RequestFailure] = []
        decode_results = None
        num_early = 0
        if decode is not None:
            decode_results, early, finalized = self._decode_exits(
                decode, decode_out, tables, failed
            )
            num_early += early
            num_finalized += finalized
        results = self._item_results(items, tables, states, loop_states, exited_items, failed)
        return RunnerOutput(
            scheduled.step_id,
            tuple(results),
            tuple(rows_per_call),
            model_time_s=time.perf_counter() - start_s,
            forward_time_s=self._forward_s,
            num_early_exits=num_early,
            num_finalize_copies=num_finalized,
            failed_requests=tuple(failed),
            decode=decode_results,
        )

    def _call(self, k, decode, items, active, tables, states, loop_states):
        """Core call k: decode rows (call 0) and the active items; the prelude first for rows
        that start here. Returns the decode rows' (input state, output state, e)."""
        positions: list[int] = []
        parts, first = [], []  # (request, depth, start, count); rows needing the prelude
        first_ids: list[int] = []
        if decode is not None:
            for i, rid in enumerate(decode.request_ids):
                depth, pos = int(decode.depths[i]), int(decode.positions[i])
                parts.append((rid, depth, pos, 1))
                if depth == 0:
                    first.append((rid, pos, 1))
                    first_ids.append(int(decode.token_ids[i]))
        for i in active:
            item = items[i]
            parts.append((item.request_id, item.depth + k, item.token_start, item.token_count))
            if k == 0 and item.needs_prelude:
                first.append((item.request_id, item.token_start, item.token_count))
                first_ids.extend(item.token_ids)
        for _, _, start, count in parts:
            positions.extend(range(start, start + count))
        started = self._prelude(first, first_ids, tables) if first else None
        # Inputs in row order: decode rows, then items.
        state_parts, e_parts, at = [], [], 0
        if decode is not None:
            for i, rid in enumerate(decode.request_ids):
                if int(decode.depths[i]) == 0:
                    state_parts.append(started[0][at : at + 1])
                    e_parts.append(started[1][at : at + 1])
                    at += 1
                else:
                    token = self.decoding[rid]
                    state_parts.append(token.state[None])
                    e_parts.append(token.e[None])
        for i in active:
            item = items[i]
            if k == 0 and item.needs_prelude:
                n = item.token_count
                states[i] = (started[0][at : at + n], started[1][at : at + n])
                at += n
            elif states[i] is None:
                resumed = self.inflight.resume(item.handle)
                states[i], loop_states[i] = resumed[:2], resumed[2]
            state_parts.append(states[i][0])
            e_parts.append(states[i][1])
        state_in = torch.cat(state_parts)
        e = torch.cat(e_parts)
        pos = self.transfers.to_device(positions)
        core = self.attention.prepare(
            [
                RowSegment(
                    tables[rid][0 if self.rules.shared else depth],
                    start,
                    count,
                    self._hidden(rid, start, depth) if self.full and count == 1 else (),
                )
                for rid, depth, start, count in parts
            ]
        )
        state_out = self._timed(self.model.core, state_in, e, pos, _Router(self.groups, core=core))
        at = 0 if decode is None else len(decode)
        if self.prompt_exits and k == 0:  # the prompts' criteria start from their states
            for i in active:
                n, item = items[i].token_count, items[i]
                if item.first_token and item.kind is ItemKind.PROMPT and item.needs_prelude:
                    rule = self._criterion()
                    rule.init(state_in[at : at + n].unsqueeze(0))
                    self._prompt_rules[i] = rule
                at += n
            at = 0 if decode is None else len(decode)
        for i in active:
            n = items[i].token_count
            states[i] = (state_out[at : at + n], e[at : at + n])
            item = items[i]
            if (
                item.kind is ItemKind.PROMPT
                and item.depth + k == self.max_loops[item.request_id] - 1
            ):
                loop_states[i] = states[i][0]
            at += n
        if decode is None:
            return None
        n = len(decode)
        return state_in[:n], state_out[:n], e[:n], pos[:n]

    def _hidden(self, request_id: str, position: int, step: int) -> tuple[int, ...]:
        """Earlier positions that did not run step `step` (lookup "full")."""
        steps = self.steps_run.get(request_id, {})
        return tuple(p for p in range(position) if steps.get(p, self.num_loops) <= step)

    def _ran(self, request_id: str, positions, steps: int) -> None:
        if self.full:
            table = self.steps_run.setdefault(request_id, {})
            for position in positions:
                table[position] = steps

    def _prelude(self, first, token_ids, tables):
        """Prelude of the rows that start a token or a prompt chunk: their `e` and initial
        state (zeros), in the order given."""
        positions = [p for _, start, count in first for p in range(start, start + count)]
        once = self.attention.prepare(
            [RowSegment(tables[rid][self.once_plane], start, count) for rid, start, count in first]
        )
        ids = self.transfers.to_device(token_ids)
        pos = self.transfers.to_device(positions)
        e = self._timed(self.model.prelude, ids, pos, _Router(self.groups, once=once))
        if self.init_scale <= 0:
            return self.model.initial_state(e, init_scale=0.0), e
        rows = [self._latent(rid, start, count) for rid, start, count in first]
        return torch.cat(rows).to(device=e.device, dtype=e.dtype), e

    def _latent(self, request_id: str, start: int, count: int) -> torch.Tensor:
        """Initial states of positions [start, start + count) of a request."""
        latents = self.latents[request_id]
        width = self.model.config.n_embd

        def draw(rows: int) -> torch.Tensor:
            blank = torch.empty(rows, width, dtype=self.dtype)
            return self.model.initial_state(
                blank, init_scale=self.init_scale, generator=latents.generator
            )

        if start < latents.prompt_len:
            if latents.prompt is None:
                latents.prompt = draw(latents.prompt_len)
            return latents.prompt[start : start + count]
        assert count == 1, "generated positions start one at a time"
        if start not in latents.drawn:
            latents.drawn[start] = draw(1)
        return latents.drawn[start]

    def _coda(self, state, segments, positions):
        once = self.attention.prepare(segments)
        pos = self.transfers.to_device(positions)
        return self._timed(self.model.coda, state, pos, _Router(self.groups, once=once))

    # ---- decode rows -------------------------------------------------------------------

    def _decode_exits(self, decode, out, tables, failed):
        state_in, state_out, e, pos = out
        n = len(decode)
        depths = decode.depths
        hazards = np.full(n, np.nan)
        hazards[decode.needs_gate] = 0.0
        gate = np.flatnonzero(decode.exit_code == GATE)
        rule = self._criterion()
        fields = rule.state_fields
        # Tokens that start here: their criterion state from their initial state.
        starting = np.flatnonzero(depths == 0)
        start_state = {}
        if len(starting):
            rule.init(state_in[starting].unsqueeze(1))
            for j, row in enumerate(starting.tolist()):
                start_state[row] = [getattr(rule, f)[j] for f in fields]
        criterion_state = {}
        for row, rid in enumerate(decode.request_ids):
            criterion_state[row] = start_state.get(row) or self.decoding[rid].criterion
        logits = None
        logit_rows: list[int] = []
        if len(gate):
            rows = gate.tolist()
            if rule.needs_logits:
                logit_rows = rows
                logits = self._decode_coda(decode, rows, state_out, tables)
            for f, name in enumerate(fields):
                setattr(rule, name, torch.stack([criterion_state[r][f] for r in rows]))
            if rule.name != "argmax-stability":  # the request's (argmax: the engine's steps)
                rule.threshold = torch.from_numpy(decode.threshold[gate]).to(self.device)
            fire, _ = rule.check(state_out[gate].unsqueeze(1), logits)
            hazards[gate] = fire.cpu().numpy().astype(np.float64)
            for j, r in enumerate(rows):
                criterion_state[r] = [getattr(rule, name)[j] for name in fields]
        exited = decide_exits(
            decode.exit_code, decode.cdf_before, decode.survival_before, hazards, decode.threshold
        )
        # Keep the tokens that go on; finalize and sample the ones that exit.
        for row, rid in enumerate(decode.request_ids):
            if exited[row]:
                self.decoding.pop(rid, None)
            else:
                self.decoding[rid] = _Token(state_out[row], e[row], criterion_state[row])
        exit_rows = np.flatnonzero(exited).tolist()
        for r in exit_rows:
            self._ran(decode.request_ids[r], [int(decode.positions[r])], int(depths[r]) + 1)
        finalized = 0
        if exit_rows:
            finalized = self._finalize(
                [(tables[decode.request_ids[r]], int(decode.positions[r]), int(depths[r]))
                 for r in exit_rows]
            )  # fmt: skip
        token_ids = np.full(n, -1, np.int64)
        logprobs: dict[int, SampledToken] = {}
        if exit_rows:
            have = {r: j for j, r in enumerate(logit_rows)}
            missing = [r for r in exit_rows if r not in have]
            extra = self._decode_coda(decode, missing, state_out, tables) if missing else None
            picked = [
                logits[have[r]] if r in have else extra[missing.index(r)]  # type: ignore[index]
                for r in exit_rows
            ]
            requests = [decode.request_ids[r] for r in exit_rows]
            sampled = self._sample(torch.stack(picked), requests, failed)
            for r, token in zip(exit_rows, sampled, strict=True):
                if token is None:
                    continue
                token_ids[r] = token.token_id
                if token.logprob is not None:
                    logprobs[r] = token
        early = int(np.count_nonzero(exited & (depths + 1 < self.num_loops)))
        return DecodeResults(exited, hazards, token_ids, logprobs), early, finalized

    def _decode_coda(self, decode, rows, state_out, tables):
        segments = [
            RowSegment(tables[decode.request_ids[r]][self.once_plane], int(decode.positions[r]), 1)
            for r in rows
        ]
        positions = [int(decode.positions[r]) for r in rows]
        index = self.transfers.to_device(rows)
        return self._coda(state_out.index_select(0, index), segments, positions)

    def _finalize(self, exits) -> int:
        """LAST_EXITED copies of tokens exiting below full depth; returns how many tokens."""
        if self.rules.shared or self.full:  # nothing deeper to fill (or to be read)
            return 0
        src, dst = finalize_slots(exits, self.block_size, self.rules.num_planes)
        if src:
            slots = self.transfers.to_device(src + dst)
            self.attention.finalize(slots[: len(src)], slots[len(src) :])
        return sum(1 for _, _, depth in exits if depth < self.num_loops - 1)

    def _sample(self, logits, request_ids, failed) -> list[SampledToken | None]:
        specs, generators, histories = [], [], []
        for rid in request_ids:
            spec, generator, history = self.samplers[rid]
            specs.append(spec)
            generators.append(generator)
            histories.append(history)
        failures: dict[int, str] = {}
        tokens = sample_rows(logits, specs, generators, self.transfers, failures, histories)
        out: list[SampledToken | None] = []
        for row, (rid, token) in enumerate(zip(request_ids, tokens, strict=True)):
            if row in failures:
                failed.append(RequestFailure(rid, failures[row]))
                out.append(None)
                continue
            if histories[row] is not None:
                histories[row].record(token.token_id)
            out.append(token)
        return out

    # ---- items -------------------------------------------------------------------------

    def _replays(self, k, items, active, tables, states, exited_items) -> int:
        """Replay rows at their recorded exit: their coda K/V and their finalize copies."""
        done = [i for i in active if items[i].kind is ItemKind.REPLAY and items[i].exit_now]
        if not done:
            return 0
        for i in done:
            exited_items[i] = True
            self._ran(items[i].request_id, [items[i].token_start], items[i].depth + k + 1)
        state = torch.cat([states[i][0] for i in done])
        segments = [RowSegment(tables[items[i].request_id][self.once_plane],
                               items[i].token_start, 1) for i in done]  # fmt: skip
        self._coda(state, segments, [items[i].token_start for i in done])
        return self._finalize(
            [(tables[items[i].request_id], items[i].token_start, items[i].depth + k)
             for i in done]
        )  # fmt: skip

    def _prompt_checks(self, k, items, active, tables, states) -> int:
        """After call k: the criterion of each whole prompt that may exit; a prompt that exits
        gets its finalize copies and its coda now. Returns the finalize copies made."""
        copies = 0
        for i in active:
            rule = self._prompt_rules.get(i)
            if rule is None:
                continue
            item, request_id = items[i], items[i].request_id
            loop = item.depth + k  # 0-based
            state = states[i][0]
            assert item.exit_rule is not None and item.token_start == 0
            r = self.max_loops[request_id]
            positions = list(range(item.token_start, item.token_start + item.token_count))
            segment = [RowSegment(tables[request_id][self.once_plane], 0, item.token_count)]
            exits, logits = loop == r - 1, None
            checks = item.exit_rule.threshold < 1.0 and loop + 1 >= item.exit_rule.min_loops
            if checks and loop < r - 1:
                if rule.needs_logits:
                    logits = self._coda(state, segment, positions)
                if rule.name != "argmax-stability":
                    rule.threshold = item.exit_rule.threshold
                fired, _ = rule.check(state.unsqueeze(0), None if logits is None else logits[-1:])
                exits = bool(fired[0])
            if not exits:
                continue
            if logits is None:
                logits = self._coda(state, segment, positions)
            self._prompt_exited[i] = (loop + 1, logits)
            self._ran(request_id, positions, loop + 1)
            del self._prompt_rules[i]
            table = tables[request_id]
            copies += self._finalize([(table, p, loop) for p in positions])
        return copies

    def _item_results(self, items, tables, states, loop_states, exited_items, failed):
        results: list[ItemResult] = []
        last = self.num_loops - 1
        for i, item in enumerate(items):
            hazards = (0.0,) * item.num_depths if item.needs_gate else ()
            if item.kind is ItemKind.REPLAY:
                if not exited_items[i]:
                    self.inflight.keep(item.request_id, item.handle, (*states[i], None))
                else:
                    self.inflight.done(item.request_id, item.handle)
                results.append(ItemResult(item.request_id, item.handle, (), exited_items[i]))
                continue
            if item.last_depth < last:
                self.inflight.keep(item.request_id, item.handle, (*states[i], loop_states[i]))
                results.append(ItemResult(item.request_id, item.handle, hazards))
                continue
            self.inflight.done(item.request_id, item.handle)
            if i in self._prompt_exited:  # its coda ran at its exit
                loops, logits = self._prompt_exited[i]
                token = self._sample(logits[-1:], [item.request_id], failed)[0]
                scores = self._score(item, logits, loops)
                results.append(
                    ItemResult(item.request_id, item.handle, (), token is not None, loops, token,
                               prompt_logprobs=scores)
                )  # fmt: skip
                continue
            state = loop_states[i]  # every row at the request's last loop
            loops = None
            if self.rules.samples_first_token(item):
                assert item.exit_rule is not None
                loops = choose_exit_from_hazards(
                    ExitMode.OURO, item.exit_rule, [0.0] * self.num_loops, item.trace_loops
                )
                assert loops == self.max_loops[item.request_id], "a first token uses r loops"
            table = tables[item.request_id][self.once_plane]
            logits = self._coda(
                state,
                [RowSegment(table, item.token_start, item.token_count)],
                list(range(item.token_start, item.token_start + item.token_count)),
            )
            scores = self._score(item, logits, self.max_loops[item.request_id])
            if loops is None:
                results.append(
                    ItemResult(item.request_id, item.handle, hazards, prompt_logprobs=scores)
                )
                continue
            token = self._sample(logits[-1:], [item.request_id], failed)[0]
            results.append(
                ItemResult(item.request_id, item.handle, hazards, token is not None, loops, token,
                           prompt_logprobs=scores)
            )  # fmt: skip
        return results

    def _score(self, item: WorkItem, logits: torch.Tensor, loops: int) -> tuple:
        """Prompt logprobs of an item with `score_ids`: row i's coda at the request's r steps
        (its exit loops under `prompt_exits`) scores `score_ids[i]`; one copy to the host."""
        if not item.score_ids:
            return ()
        assert not item.score_cached, "Huginn publishes no scored pages"
        count, top = len(item.score_ids), item.score_top
        logprobs = torch.log_softmax(logits[:count].float(), dim=-1)
        chosen = logprobs.gather(1, self.transfers.to_device(list(item.score_ids))[:, None])
        rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
        columns = [chosen.double(), rank.double()]
        if top:
            values, indices = logprobs.topk(top, dim=-1)
            columns += [values.double(), indices.double()]
        flat = self.transfers.to_host(torch.cat(columns, dim=1).reshape(-1))
        width, entries = 2 + 2 * top, []
        for row, token_id in enumerate(item.score_ids):
            values = flat[row * width : (row + 1) * width]
            alternatives = tuple((int(values[2 + top + j]), values[2 + j]) for j in range(top))
            entries.append(SampledToken(token_id, values[0], alternatives, int(values[1]), loops))
        return tuple(entries)
