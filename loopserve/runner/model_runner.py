"""The model runner: executes one `SchedulerOutput` with tensors and returns plain results.

It owns every tensor: the model, the paged KV cache, per-request sampling generators, and
the hidden states of work in flight (a decode token between loops, a prompt chunk between
depths) behind the scheduler's opaque handles. Per core call it embeds only rows that need a
prelude, computes hazards only for rows that need a signal, runs the coda and sampler only
for exiting rows, and finalizes LAST_EXITED planes after early exits. It decides each exit
with the pure functions of `loopserve.exit` (`loop_exits`, `choose_exit_from_hazards`) and
reports it; the scheduler records it. It never sees a `Request`. One of the two `Executor`s
(the other is the simulator's `SimExecutor`).

With `batch_invariant` the runner converts its model to the row-invariant forms of
`loopserve.runner.batch_invariant` (and uses that module's attention backend), so every row's
bits depend only on its own inputs.

Per-request setup is isolated: each new request's state is built by `setup_request` and
installed only when that succeeds; a request whose setup raises is reported in
`RunnerOutput.failed_requests`, keeps no state, and its items run no rows this step.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from loopserve.contracts import (
    Executor,
    ItemKind,
    ItemResult,
    NewRequestData,
    RequestFailure,
    RunnerOutput,
    SampledToken,
    SampleSpec,
    SchedulerOutput,
    StepRules,
    WorkItem,
)
from loopserve.exit import ExitMode, GateState, choose_exit_from_hazards, loop_exits
from loopserve.models.ouro import OuroForLoopedLM, make_hazard_fn
from loopserve.runner.attention.base import RowSegment, finalize_slots
from loopserve.runner.attention.prefix_groups import plan_prefix_groups
from loopserve.runner.attention.registry import make_attention_backend
from loopserve.runner.batch_invariant import make_batch_invariant, row_by_row
from loopserve.runner.graphs import build_decode_graphs
from loopserve.runner.handles import HandleTable
from loopserve.runner.sampler import is_greedy, make_generator, sample_rows
from loopserve.runner.swap import InFlight, KVMoves
from loopserve.runner.transfers import Transfers

logger = logging.getLogger(__name__)
Sampler = tuple[SampleSpec, torch.Generator | None]


class ModelRunner(Executor):
    def __init__(
        self,
        model: OuroForLoopedLM,
        *,
        num_blocks: int,
        block_size: int,
        layout: str,
        exit_mode: str,
        lookahead_seed: int = 0,
        num_host_blocks: int = 0,
        attention_backend: str = "auto",
        graph_mode: str = "off",
        max_model_len: int | None = None,
        max_num_seqs: int = 1,
        batch_invariant: bool = False,
        cascade_attention: bool = False,
    ) -> None:
        """`graph_mode`: 'off' (eager), 'emulate' or 'capture' (`loopserve.runner.graphs`);
        with graphs the KV tensor has one extra block (index `num_blocks`) for padding rows.
        `batch_invariant`: run the model it is given row by row, in place
        (`loopserve.runner.batch_invariant`); needs graph_mode 'off'."""
        assert not (batch_invariant and graph_mode != "off"), "graphs pad rows"
        if batch_invariant:
            make_batch_invariant(model)
        self.model = model
        config = model.config
        self.num_loops = model.num_loops
        self.block_size = block_size
        self.rules = StepRules.of(layout, self.num_loops)
        self.shared = self.rules.shared
        self.exit_mode = ExitMode(exit_mode)
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.scale = config.head_dim**-0.5
        # [layers, K/V, slots, kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            (
                config.num_hidden_layers,
                2,
                (num_blocks + (graph_mode != "off")) * block_size,
                config.num_key_value_heads,
                config.head_dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        lookahead = lookahead_seed if self.exit_mode is ExitMode.RANDOM_LOOKAHEAD else None
        self.hazard_fn = make_hazard_fn(model, lookahead_seed=lookahead)
        if batch_invariant:
            self.hazard_fn = row_by_row(self.hazard_fn)
        self.samplers: dict[str, Sampler] = {}
        self.inflight: HandleTable[InFlight] = HandleTable()  # state between steps
        self._forward_s = 0.0  # this step's time inside model calls (prelude/core/gate/coda)
        self._num_finalized = 0  # this step's finalized decode tokens
        self.transfers = Transfers(self.device)  # every host<->device copy, counted
        self.moves = KVMoves(self.kv_cache, num_host_blocks, block_size, self.inflight)
        self.swap = self.moves.swap
        # Hidden states of swapped-out requests: request_id -> handle -> state (on the host).
        self.swapped_inflight = self.moves.swapped_inflight
        # Handed-off requests not yet admitted: request_id -> (K/V blocks, generator state).
        self.staged_imports = self.moves.staged_imports
        self.attention = make_attention_backend(
            attention_backend,
            self.kv_cache,
            block_size=block_size,
            scale=self.scale,
            batch_invariant=batch_invariant,
            cascade=cascade_attention,
        )
        self.graphs, self.graph_capture_error = build_decode_graphs(
            graph_mode,
            model.core,
            self.kv_cache,
            attention=self.attention,
            max_model_len=max_model_len or config.max_position_embeddings,
            hidden_size=config.hidden_size,
            block_size=block_size,
            max_rows=max_num_seqs,
            dummy_block=num_blocks,
            scale=self.scale,
            num_planes=self.rules.num_planes,
            transfers=self.transfers,
        )

    @staticmethod
    def kv_bytes_per_block(model: OuroForLoopedLM, block_size: int, dtype: torch.dtype) -> int:
        per_position = model.config.kv_elements_per_token_per_depth
        return per_position * block_size * torch.empty(0, dtype=dtype).element_size()

    # ---- request bookkeeping ----------------------------------------------------------

    def _apply_bookkeeping(self, scheduled: SchedulerOutput) -> tuple[RequestFailure, ...]:
        """Drop released requests' state, set up new requests one by one; returns the new
        requests whose setup raised (none of their state is kept)."""
        for request_id in scheduled.finished_request_ids:
            self._drop_request(request_id)
        failures = []
        for new in scheduled.new_requests:
            try:
                self.samplers[new.request_id] = self.setup_request(new)
            except Exception as err:  # fails this request only; reported, not swallowed
                logger.exception("setup of request %s failed", new.request_id)
                self._drop_request(new.request_id)
                failures.append(RequestFailure(new.request_id, f"{type(err).__name__}: {err}"))
        for transfer in scheduled.kv_transfers:  # in order: see `runner.swap`
            self.moves.apply(transfer)
            self._forget_tables(transfer.request_id)  # its blocks moved
        for request_id in scheduled.preempted_request_ids:
            self.inflight.release(request_id)  # recompute: hidden states go, the sampler stays
            self._forget_tables(request_id)
        return tuple(failures)

    def setup_request(self, new: NewRequestData) -> Sampler:
        """Build one new request's per-request state (its sampler); the caller installs it
        only if this returns, so a setup that raises leaves nothing behind."""
        greedy = is_greedy(new.sample_spec)
        generator = None if greedy else make_generator(new.seed, self.device)
        staged = self.staged_imports.get(new.request_id)
        if generator is not None and staged is not None and staged[1] is not None:
            # A handed-off request continues its exporter's random stream.
            generator.set_state(torch.frombuffer(bytearray(staged[1]), dtype=torch.uint8))
        return new.sample_spec, generator

    # ---- hand-off (prefill/decode disaggregation) -------------------------------------------

    def export_request(
        self,
        request_id: str,
        table: tuple[list[int], ...],
        num_positions: int,
        *,
        to_host: bool = True,
    ) -> tuple[torch.Tensor, bytes | None]:
        """A copy of the K/V of positions [0, num_positions) of every plane of `table` (see
        `KVMoves.export`) and the request's generator state (None when greedy). The request
        must have no work in flight (it is between decode tokens)."""
        assert not self.inflight.handles_of(request_id), f"{request_id} has work in flight"
        kv = self.moves.export(table, num_positions, to_host=to_host)
        generator = self.samplers[request_id][1]
        state = None if generator is None else generator.get_state().numpy().tobytes()
        return kv, state

    def stage_import(
        self, request_id: str, kv: torch.Tensor, generator_state: bytes | None
    ) -> None:
        """Hold a handed-off request's K/V and generator state until the scheduler admits it
        (`KVTransfer(IMPORT)` and its `NewRequestData`), or releases it (aborted first)."""
        self.moves.stage_import(request_id, kv, generator_state)

    def _forget_tables(self, request_id: str) -> None:
        if self.graphs is not None:
            self.graphs.release(request_id)

    def _drop_request(self, request_id: str) -> None:
        self._forget_tables(request_id)
        self.samplers.pop(request_id, None)
        self.inflight.release(request_id)
        self.moves.drop(request_id)

    @property
    def num_live_handles(self) -> int:
        return len(self.inflight)

    @property
    def inflight_rows(self) -> int:
        return sum(state.hidden.shape[0] for state in self.inflight.states())

    # ---- execution ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        failures = self._apply_bookkeeping(scheduled)
        if failures:
            return self._run_without(scheduled, failures)
        return self._run(scheduled)

    def _run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the step's items (its bookkeeping is already applied)."""
        items = scheduled.items
        if not items:
            return RunnerOutput(scheduled.step_id, ())
        start_s, self._forward_s = time.perf_counter(), 0.0
        self.transfers.discard_deferred()  # a failed step's leftovers, if any
        transfers0 = self.transfers.counts()
        hazards: list[list[float]] = [[] for _ in items]
        last_outputs: list[list[torch.Tensor]] = [[] for _ in items]
        states = self._initial_states(items, hazards, last_outputs)
        exited = [False] * len(items)
        self._num_finalized = 0
        calls0 = self.graphs.num_calls if self.graphs is not None else 0
        pad0 = self.graphs.num_padded_rows if self.graphs is not None else 0
        rows_per_call = []
        for k in range(max(item.num_depths for item in items)):
            active = [i for i, item in enumerate(items) if k < item.num_depths]
            rows_per_call.append(sum(items[i].token_count for i in active))
            graphed = self._core_call(scheduled, items, active, k, states)
            self._signals(
                scheduled.block_tables, items, active, states, hazards, last_outputs, exited,
                graphed,
            )  # fmt: skip
        results, failed = self._coda(items, states, hazards, last_outputs, exited)
        num_early = sum(
            1 for r in results if r.loops_used is not None and r.loops_used < self.num_loops
        )
        # No synchronize: the step's last copy to the host (sampled ids, hazards) waited for
        # the device already; a step without one leaves the device running ahead.
        h2d, d2h, h2d_bytes, d2h_bytes = (
            now - before for now, before in zip(self.transfers.counts(), transfers0)
        )
        graph_calls = padded = 0
        if self.graphs is not None:
            graph_calls, padded = self.graphs.num_calls - calls0, self.graphs.num_padded_rows - pad0
        return RunnerOutput(
            scheduled.step_id,
            tuple(results),
            tuple(rows_per_call),
            model_time_s=time.perf_counter() - start_s,
            forward_time_s=self._forward_s,
            num_early_exits=num_early,
            num_finalize_copies=self._num_finalized,
            num_graph_calls=graph_calls,
            num_padded_rows=padded,
            failed_requests=failed,
            num_h2d_transfers=h2d,
            num_d2h_transfers=d2h,
            h2d_bytes=h2d_bytes,
            d2h_bytes=d2h_bytes,
        )

    def _run_without(
        self, scheduled: SchedulerOutput, failures: tuple[RequestFailure, ...]
    ) -> RunnerOutput:
        """Run the step without the items of requests whose setup failed; those items get
        empty results, so results stay one per item, in item order."""
        failed_ids = {failure.request_id for failure in failures}
        kept = tuple(item for item in scheduled.items if item.request_id not in failed_ids)
        output = self._run(dataclasses.replace(scheduled, items=kept))
        ran = iter(output.results)
        results = tuple(
            ItemResult(item.request_id, item.handle) if item.request_id in failed_ids else next(ran)
            for item in scheduled.items
        )
        return dataclasses.replace(
            output, results=results, failed_requests=failures + output.failed_requests
        )

    def _timed(self, fn, *args) -> torch.Tensor:
        """Call a model function, adding its duration to this step's forward time.

        On CUDA this counts launch time only (no synchronize per call), so the host share it
        implies is an upper bound there; on CPU it is the op time itself."""
        start_s = time.perf_counter()
        out = fn(*args)
        self._forward_s += time.perf_counter() - start_s
        return out

    def _initial_states(
        self, items: tuple[WorkItem, ...], hazards, last_outputs
    ) -> list[torch.Tensor]:
        fresh = [i for i, item in enumerate(items) if item.needs_prelude]
        states: list[torch.Tensor | None] = [None] * len(items)
        if fresh:
            token_ids = [t for i in fresh for t in items[i].token_ids]
            embedded = self._timed(self.model.prelude, self.transfers.to_device(token_ids))
            for i, chunk in zip(fresh, embedded.split([items[i].token_count for i in fresh])):
                states[i] = chunk
        for i, item in enumerate(items):
            if states[i] is None:
                resumed = self.inflight.resume(item.handle)
                states[i] = resumed.hidden
                if item.first_token:  # the last prompt row's earlier depths
                    hazards[i], last_outputs[i] = resumed.hazards, resumed.last_rows
        return states  # type: ignore[return-value]

    def _core_call(self, scheduled, items, active, k, states) -> torch.Tensor | None:
        """One core call over the active items; returns its output [rows, H] when it ran
        through the graphs (one row per item, in `active` order), else None."""
        graphs = self.graphs
        groups = None  # prefix groups of a decode-only call, when cascade attention looked
        if (
            graphs is not None
            and graphs.fits(len(active), max(items[i].token_start for i in active))
            and all(items[i].kind is ItemKind.DECODE for i in active)
        ):  # decode-only call: the static, bucketed path (one row per item)
            keys = [(items[i].request_id, self.rules.plane(items[i], k)) for i in active]
            tables = [scheduled.block_tables[rid][plane] for rid, plane in keys]
            positions = [items[i].token_start for i in active]
            # Rows that share a prefix run eagerly instead: that call reads it once per group
            # (the backend takes the groups found here instead of finding them again).
            if self.attention.cascade:
                groups = plan_prefix_groups(tables, positions, self.block_size)
            if not groups:  # none found (or not looked for): the graphs
                return self._graph_call(graphs, active, states, positions, tables, keys)
        segments = []
        positions: list[int] = []
        for i in active:
            item = items[i]
            table = scheduled.block_tables[item.request_id][self.rules.plane(item, k)]
            segments.append(RowSegment(table, item.token_start, item.token_count))
            positions.extend(range(item.token_start, item.token_start + item.token_count))
        attn = self.attention.prepare(segments, prefix_groups=groups)
        hidden = torch.cat([states[i] for i in active])
        position_ids = self.transfers.to_device(positions)
        out = self._timed(self.model.core, hidden, position_ids, attn)
        for i, chunk in zip(active, out.split([items[i].token_count for i in active])):
            states[i] = chunk
        return None

    def _graph_call(self, graphs, active, states, positions, tables, keys) -> torch.Tensor:
        hidden = torch.cat([states[i] for i in active])
        bucket = graphs.load(hidden, positions, tables, keys)  # host work: not forward time
        out = self._timed(graphs.launch, bucket, len(active))
        for i, row in zip(active, out.split(1)):
            states[i] = row
        return out

    def _signals(
        self, tables, items, active, states, hazards, last_outputs, exited, graphed
    ) -> None:
        """Hazards for rows that need them, exit decisions, finalize copies. `graphed`: the
        call's output when it ran through the graphs (one row per active item)."""
        gated = [i for i in active if items[i].needs_gate]
        if gated:
            if graphed is not None and gated == active:
                rows = graphed  # every row of the decode call is gated: no gather
            else:
                rows = torch.cat([states[i][-1:] for i in gated])
            values = self._timed(self.hazard_fn, rows).float()  # [gated], on the device

            def receive(read: list[float], gated=gated) -> None:
                for i, value in zip(gated, read):
                    hazards[i].append(value)

            # Read now only when this loop's exit decisions need the values (the `ouro` rule);
            # otherwise they ride along with the step's next copy to the host.
            if any(items[i].exit_now is None and items[i].kind is not ItemKind.PROMPT
                   for i in gated):  # fmt: skip
                receive(self.transfers.to_host(values))
            else:
                self.transfers.defer(values, receive)
        finalize = []
        for i in active:
            item = items[i]
            if item.kind is ItemKind.PROMPT:
                if item.first_token:
                    last_outputs[i].append(states[i][-1:])
                continue
            before = GateState(item.cdf_before, item.survival_before)
            # Only a gate-decided loop reads its hazard (read to the host above).
            hazard = hazards[i][-1] if item.exit_now is None else None
            exited[i] = loop_exits(item.exit_now, before, hazard, item.threshold)
            if self.rules.finalizes(item, exited[i]):
                finalize.append(item)
        if finalize:
            self._finalize(tables, finalize)
            self._num_finalized += len(finalize)

    def _finalize(self, tables, items: list[WorkItem]) -> None:
        """Copy each exited token's K/V of its exit depth into every deeper plane."""
        exits = [(tables[item.request_id], item.token_start, item.depth) for item in items]
        src, dst = finalize_slots(exits, self.block_size, self.num_loops)
        slots = self.transfers.to_device(src + dst)  # one copy: sources, then destinations
        self.attention.finalize(slots[: len(src)], slots[len(src) :])

    def _coda(
        self, items, states, hazards, last_outputs, exited
    ) -> tuple[list[ItemResult], tuple[RequestFailure, ...]]:
        """Coda and sampling of the exiting rows; the items' results and the requests whose
        sampling raised (each fails alone)."""
        failed: list[RequestFailure] = []
        coda_rows: list[torch.Tensor] = []
        coda_items: list[int] = []
        loops_used: dict[int, int] = {}
        first_tokens = [self.rules.samples_first_token(item) for item in items]
        if any(first_tokens):
            self.transfers.flush()  # the first token's exit is chosen from its hazards
        for i, item in enumerate(items):
            if item.kind is ItemKind.DECODE and exited[i]:
                coda_rows.append(states[i])
                coda_items.append(i)
                loops_used[i] = item.depth + 1
            elif first_tokens[i]:
                assert item.exit_rule is not None
                loops = choose_exit_from_hazards(
                    self.exit_mode, item.exit_rule, hazards[i] or None, item.trace_loops
                )
                coda_rows.append(last_outputs[i][loops - 1])
                coda_items.append(i)
                loops_used[i] = loops
        sampled: dict[int, SampledToken] = {}
        if coda_rows:
            logits = self._timed(self.model.coda, torch.cat(coda_rows))
            specs, generators = zip(*(self.samplers[items[i].request_id] for i in coda_items))
            failures: dict[int, str] = {}
            tokens = sample_rows(logits, list(specs), list(generators), self.transfers, failures)
            for row, (i, token) in enumerate(zip(coda_items, tokens)):
                if row in failures:  # this request fails alone; the call's other rows go on
                    failed.append(
                        RequestFailure(items[i].request_id, f"sampling failed: {failures[row]}")
                    )
                    continue
                sampled[i] = token
        self.transfers.flush()  # hazards not read yet (no coda this step)
        results = []
        for i, item in enumerate(items):
            token = sampled.get(i)
            if self.rules.releases_handle(item, exited[i], token is not None):
                self.inflight.done(item.request_id, item.handle)
            else:
                state = InFlight(states[i], hazards[i], last_outputs[i])
                self.inflight.keep(item.request_id, item.handle, state)
            item_hazards = tuple(hazards[i][-item.num_depths :]) if item.needs_gate else ()
            exited_now = bool(exited[i]) or token is not None
            results.append(
                ItemResult(
                    item.request_id, item.handle, item_hazards, exited_now, loops_used.get(i), token
                )
            )
        return results, tuple(failed)
