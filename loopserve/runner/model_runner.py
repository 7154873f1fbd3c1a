"""The model runner: executes one `SchedulerOutput` with tensors and returns plain results.

It owns every tensor: the model, the paged KV cache, per-request sampling generators, and
the hidden states of work in flight (a decode token between loops, a prompt chunk between
depths) behind the scheduler's opaque handles. Per core call it embeds only rows that need a
prelude, computes hazards only for rows that need a signal and finalizes LAST_EXITED planes
after early exits; exiting rows go to the coda and sampler (`runner/coda.py`). Exits are
decided by `loopserve.exit`'s pure functions and reported; the rules it shares with the
simulator's `SimExecutor` are `contracts.StepRules`. It never sees a `Request`.

With `batch_invariant` the model takes the row-invariant forms of `runner/batch_invariant.py`
(and its attention backend): every row's bits depend only on its own inputs.

Per-request setup is isolated: each new request's state is built by `setup_request` and
installed only when that succeeds; a request whose setup raises is reported in
`RunnerOutput.failed_requests`, keeps no state, and its items run no rows this step.
"""

from __future__ import annotations

import logging
import time

import torch

from loopserve.contracts import (
    Executor,
    ItemKind,
    KVHandle,
    NewRequestData,
    RequestFailure,
    RunnerOutput,
    SampleSpec,
    SchedulerOutput,
    StepRules,
    WorkItem,
    run_without_failed,
)
from loopserve.exit import ExitMode, GateState, loop_exits
from loopserve.models.ouro import OuroForLoopedLM, make_hazard_fn
from loopserve.runner.attention.base import RowSegment, finalize_slots
from loopserve.runner.attention.prefix_groups import plan_prefix_groups
from loopserve.runner.attention.registry import make_attention_backend
from loopserve.runner.batch_invariant import make_batch_invariant, row_by_row
from loopserve.runner.coda import Coda
from loopserve.runner.graphs import build_decode_graphs
from loopserve.runner.handles import HandleTable
from loopserve.runner.sampler import generator_state, is_greedy, make_generator, restore_generator
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
        self.coda = Coda(
            rules=self.rules,
            exit_mode=self.exit_mode,
            coda=lambda rows: self._timed(model.coda, rows),
            samplers=self.samplers,
            transfers=self.transfers,
            inflight=self.inflight,
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
        if generator is not None and staged is not None:  # continue the exporter's stream
            restore_generator(generator, staged[1])
        return new.sample_spec, generator

    # ---- hand-off (prefill/decode disaggregation) -------------------------------------------

    def export_request(
        self, handle: KVHandle, *, to_host: bool = True
    ) -> tuple[torch.Tensor, bytes | None]:
        """A copy of the K/V `handle` names (every plane, see `KVMoves.export`) and the
        request's generator state (None when greedy); nothing of it may be in flight."""
        request_id = handle.request_id
        assert not self.inflight.handles_of(request_id), f"{request_id} has work in flight"
        kv = self.moves.export(handle.block_tables, handle.num_positions, to_host=to_host)
        return kv, generator_state(self.samplers[request_id][1])

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
            return run_without_failed(scheduled, failures, self._run)
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
        results, failed = self.coda(items, states, hazards, last_outputs, exited)
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
