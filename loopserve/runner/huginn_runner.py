"""The Huginn executor: continuous depth batching for a model with a prelude and a coda of
attention layers, input injection at every step, and convergence exit criteria.

It executes the same `SchedulerOutput` as `ModelRunner` (decode rows as columns, prompt and
replay items, refill and no_refill, every prompt arm) with eager calls on a paged attention
backend (torch, or the Triton kernels on CUDA); rows of different requests at different
recurrence steps share each core call. Every request holds the layout's step planes plus
the *once planes* (the last of its block tables) for the prelude's and coda's K/V, one entry
per position; `LayerRouter` sends each layer to its plane. A row carries its state and `e`,
the prelude output every step injects. Exits follow the `criterion` exit mode: the
request's criterion is checked on the loops the scheduler plans as GATE and its score is
reported as the row's signal (`DecodeExits`); prompts run at full depth
and their coda runs at the request's r-th step (or exit as one token with `prompt_exits`:
`PromptExits`); with the `full` lookup nothing is finalized and one-row items do not attend
to positions that did not run their step. docs/model_families.md has the rules and what
each reproduces of the authors' code; `huginn_requests.py` keeps per-request state.
"""

from __future__ import annotations

import logging
import time

import torch

from loopserve.contracts import (
    ItemKind,
    KVHandle,
    NewRequestData,
    RequestFailure,
    RunnerOutput,
    RunnerStats,
    SchedulerOutput,
)
from loopserve.execution import Executor, StepRules, run_without_failed
from loopserve.exit.criteria import ExitCriterion, make_criterion
from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.runner.attention.base import RowSegment, finalize_slots
from loopserve.runner.attention.registry import make_attention_backend
from loopserve.runner.huginn_exits import DecodeExits, PromptExits
from loopserve.runner.huginn_items import PromptItems
from loopserve.runner.huginn_parts import (
    LayerRouter,
    make_huginn_batch_invariant,
    prepare_once,
    refused_items,
)
from loopserve.runner.huginn_requests import HuginnRequests
from loopserve.runner.sampler import generator_state
from loopserve.runner.swap import SwapSpace
from loopserve.runner.transfers import Transfers

logger = logging.getLogger(__name__)


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
        batch_invariant: bool = False,
        make_matcher=None,
    ) -> None:
        """`attention_backend`: a name of `runner.attention.registry` (the Triton kernels on
        CUDA; the same calls, eagerly, as for the torch path). `batch_invariant`: the model
        it is given runs row by row, in place (`make_huginn_batch_invariant`), and attention
        is the row-invariant torch path."""
        config = model.config
        if batch_invariant:
            make_huginn_batch_invariant(model)
        self.model = model
        self.num_loops = model.num_loops
        self.block_size = block_size
        self.rules = StepRules.of(layout, self.num_loops)
        # The once planes (prelude and coda K/V) follow the step planes in every request's
        # block tables; every plane has the core's layers (`HuginnConfig.extra_kv_planes`).
        first_once = self.rules.num_planes
        self.once_planes = range(first_once, first_once + config.extra_kv_planes)
        self.groups = config.layer_groups
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache = torch.zeros(
            (
                config.num_core_layers,
                2,
                num_blocks * block_size,
                config.num_key_value_heads,
                config.head_dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        self.transfers = Transfers(self.device)
        # Swap preemption: blocks of every plane (the once planes too) go to host memory; the
        # request's paused work waits here, on the device, until it swaps back in.
        self.swap = SwapSpace(self.kv_cache, num_host_blocks, block_size)
        self.attention = make_attention_backend(
            attention_backend, self.kv_cache, block_size=block_size,
            scale=config.head_dim**-0.5, transfers=self.transfers,
            batch_invariant=batch_invariant,
        )  # fmt: skip
        self.vocab_size = config.vocab_size
        self.criterion_name = criterion
        self.criterion_threshold = criterion_threshold
        make_criterion(criterion, vocab_size=config.vocab_size, threshold=criterion_threshold)
        self.init_scale = init_scale
        self.prompt_exits = prompt_exits
        self.full = lookup == "full"  # the authors' default lookup: see `HuginnRequests`
        self.requests = HuginnRequests(
            num_loops=self.num_loops, shared=self.rules.shared, vocab_size=config.vocab_size,
            device=self.device, transfers=self.transfers, swap=self.swap,
            make_matcher=make_matcher, full=self.full, init_scale=init_scale,
            draw=self._draw,
        )  # fmt: skip
        requests = self.requests  # the same objects under the runner's names (tests read them)
        self.samplers, self.max_loops, self.latents = (
            requests.samplers,
            requests.max_loops,
            requests.latents,
        )
        self.steps_run, self.swapped = requests.steps_run, requests.swapped
        self.staged_imports = requests.staged_imports
        self.decoding, self.inflight = requests.decoding, requests.inflight
        self._forward_s = 0.0
        self.decode_exits = DecodeExits(
            criterion=self._criterion, decoding=self.decoding, decode_coda=self._decode_coda,
            finalize=self._finalize, sample=self.requests.sample, ran=self.requests.ran,
            num_loops=self.num_loops, device=self.device,
        )  # fmt: skip
        self.prompts = PromptExits(
            criterion=self._criterion, max_loops=self.max_loops, coda=self._coda, finalize=self._finalize, ran=self.requests.ran,
        )  # fmt: skip
        self.items = PromptItems(
            inflight=self.inflight, rules=self.rules, max_loops=self.max_loops, prompts=self.prompts, coda=self._coda,
            finalize=self._finalize, sample=self.requests.sample, ran=self.requests.ran,
            transfers=self.transfers, prompt_exits=prompt_exits,
        )  # fmt: skip

    def _draw(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        """`rows` random initial states from a request's generator (the authors' draws)."""
        blank = torch.empty(rows, self.model.config.n_embd, dtype=self.dtype)
        return self.model.initial_state(blank, init_scale=self.init_scale, generator=generator)

    @property
    def num_live_handles(self) -> int:
        return self.requests.num_live_handles

    def setup_request(self, new: NewRequestData) -> tuple:
        return self.requests.setup_request(new)

    # ---- hand-off (prefill/decode disaggregation) ---------------------------------------

    def export_request(
        self, handle: KVHandle, *, to_host: bool = True
    ) -> tuple[torch.Tensor, bytes | None]:
        """A copy of the K/V `handle` names (every plane, the once planes included) and the
        request's sampler state; nothing of it may be in flight."""
        request_id = handle.request_id
        assert not self.inflight.handles_of(request_id), f"{request_id} has work in flight"
        assert request_id not in self.decoding, f"{request_id} has a token in flight"
        kv = self.swap.export_blocks(handle.block_tables, handle.num_positions, to_host=to_host)
        return kv, generator_state(self.samplers[request_id][1])

    def export_runner_state(self, request_id: str) -> dict:
        return self.requests.export_state(request_id)

    def stage_import(
        self,
        request_id: str,
        kv: torch.Tensor,
        generator_state: bytes | None,
        *,
        runner_state: object = None,
    ) -> None:
        """Hold a handed-off request's K/V, sampler and runner state until the scheduler
        admits it (`NewRequestData`, then `KVTransfer(IMPORT)`), or releases it."""
        self.swap.check_import(kv)
        if not isinstance(runner_state, dict):
            raise ValueError("a Huginn hand-off carries its runner state (export_runner_state)")
        self.requests.staged_imports[request_id] = (kv, generator_state, runner_state)

    def _criterion(self) -> ExitCriterion:
        return make_criterion(
            self.criterion_name, vocab_size=self.vocab_size, threshold=self.criterion_threshold
        )

    # ---- execution ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        failures = self.requests.bookkeeping(scheduled)
        reasons = refused_items(scheduled.items, self.prompt_exits, self.requests.prompt_lens)
        for failure in failures:
            reasons.pop(failure.request_id, None)
        if reasons:  # fails those requests alone, with the reason
            for request_id in reasons:
                self.requests.drop(request_id)
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
        self.prompts.begin()  # prompt exits: per item, its criterion, then its exit
        for k in range(num_calls):
            active = [
                i
                for i, item in enumerate(items)
                if k < item.num_depths and i not in self.prompts.exited
            ]
            rows = decode if (k == 0 and decode is not None) else None
            if not active and rows is None:
                break
            out = self._call(k, rows, items, active, tables, states, loop_states)
            if self.prompt_exits:
                num_finalized += self.prompts.check(k, items, active, tables, states)
            rows_per_call.append(
                sum(items[i].token_count for i in active) + (0 if rows is None else len(rows))
            )
            if rows is not None:
                decode_out = out
            num_finalized += self.items.replays(k, items, active, tables, states, exited_items)
        failed: list[RequestFailure] = []
        decode_results = None
        num_early = 0
        if decode is not None:
            decode_results, early, finalized = self.decode_exits(decode, decode_out, tables, failed)
            num_early += early
            num_finalized += finalized
        results = self.items.results(items, tables, states, loop_states, exited_items, failed)
        stats = RunnerStats(
            tuple(rows_per_call),
            model_time_s=time.perf_counter() - start_s,
            forward_time_s=self._forward_s,
            num_early_exits=num_early,
            num_finalize_copies=num_finalized,
        )
        return RunnerOutput(scheduled.step_id, tuple(results), tuple(failed), decode_results, stats)

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
                    self.requests.hidden(rid, start, depth) if self.full and count == 1 else (),
                )
                for rid, depth, start, count in parts
            ]
        )
        state_out = self._timed(
            self.model.core, state_in, e, pos, LayerRouter(self.groups, core=core)
        )
        at = 0 if decode is None else len(decode)
        if self.prompt_exits and k == 0:  # the prompts' criteria start from their states
            for i in active:
                n, item = items[i].token_count, items[i]
                if item.kind is ItemKind.PROMPT and item.first_token and item.needs_prelude:
                    self.prompts.start(i, state_in[at : at + n])
                at += n
            at = 0 if decode is None else len(decode)
        for i in active:
            n = items[i].token_count
            states[i] = (state_out[at : at + n], e[at : at + n])
            item = items[i]
            # Every row's state at its last prompt loop (the request's r, or its exit).
            if item.kind is ItemKind.PROMPT and item.depth + k == self.rules.final_prompt_depth(
                item
            ):
                loop_states[i] = states[i][0]
            at += n
        if decode is None:
            return None
        n = len(decode)
        return state_in[:n], state_out[:n], e[:n], pos[:n]

    def _prelude(self, first, token_ids, tables):
        """Prelude of the rows that start a token or a prompt chunk: their `e` and initial
        state (zeros, or the request's random draws with `init_scale` > 0), in order."""
        positions = [p for _, start, count in first for p in range(start, start + count)]
        once = prepare_once(
            self.attention, self.once_planes, [(tables[rid], s, c) for rid, s, c in first]
        )
        ids = self.transfers.to_device(token_ids)
        pos = self.transfers.to_device(positions)
        e = self._timed(self.model.prelude, ids, pos, LayerRouter(self.groups, once=once))
        if self.init_scale <= 0:
            return self.model.initial_state(e, init_scale=0.0), e
        rows = [self.requests.initial_rows(rid, start, count) for rid, start, count in first]
        return torch.cat(rows).to(device=e.device, dtype=e.dtype), e

    def _coda(self, state, spans, positions):
        """The coda of `state` rows at `positions`; `spans`: their `OnceSpan`s, in order."""
        once = prepare_once(self.attention, self.once_planes, spans)
        pos = self.transfers.to_device(positions)
        return self._timed(self.model.coda, state, pos, LayerRouter(self.groups, once=once))

    # ---- decode rows -------------------------------------------------------------------

    def _decode_coda(self, decode, rows, state_out, tables):
        spans = [(tables[decode.request_ids[r]], int(decode.positions[r]), 1) for r in rows]
        positions = [int(decode.positions[r]) for r in rows]
        index = self.transfers.to_device(rows)
        return self._coda(state_out.index_select(0, index), spans, positions)

    def _finalize(self, exits) -> int:
        """LAST_EXITED copies of tokens exiting below full depth; returns how many tokens."""
        if self.rules.shared or self.full:  # nothing deeper to fill (or to be read)
            return 0
        src, dst = finalize_slots(exits, self.block_size, self.rules.num_planes)
        if src:
            slots = self.transfers.to_device(src + dst)
            self.attention.finalize(slots[: len(src)], slots[len(src) :])
        return sum(1 for _, _, depth in exits if depth < self.num_loops - 1)
