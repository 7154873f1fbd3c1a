"""The model runner: executes one `SchedulerOutput` with tensors and returns plain results.

One executor for every looped family: it reads a model only through its math
(`models/family.py`, `LoopedModel`: carried state width, K/V groups, exit-signal kind,
enter / loop / leave), called through `runner/loop_calls.py`. It owns every tensor: the model, the paged KV cache, per-request sampling generators, the
persistent decode state (each decoding request's in-flight token between loops, in a slot
of one device tensor: `runner/decode_rows.py`) and the hidden states of other work in flight
(a prompt chunk between depths, a replay row) behind the scheduler's opaque handles. Per core
call it embeds only rows that need a prelude, computes hazards only for calls with rows that
need a signal and finalizes LAST_EXITED planes after early exits; exiting rows go to the coda
and sampler (`runner/coda.py`). Decode rows arrive as columns and cost a constant number of
tensor operations per call (one staged copy in, one packed copy out when their exits are
known or their gate-decided rows sample greedily). Exits are decided by `loopserve.exit`'s
rules (on the device for decode rows) and reported; the rules it shares with the
simulator's `SimExecutor` are `execution.StepRules`. It never sees a `Request`.

With `batch_invariant` the model takes the row-invariant forms of `runner/batch_invariant.py`
(and its attention backend): every row's bits depend only on its own inputs.

Per-request setup is isolated: each new request's state is built by `setup_request` and
installed only when that succeeds; a request whose setup raises is reported in
`RunnerOutput.failed_requests`, keeps no state, and its items run no rows this step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from loopserve.contracts import (
    BlockTables,
    DecodeRows,
    LeaveRows,
    NewRequestData,
    RequestFailure,
    RunnerOutput,
    RunnerStats,
    SampleSpec,
    SchedulerOutput,
)
from loopserve.errors import InvalidRequestError
from loopserve.execution import Executor, StepRules, run_without_failed, set_up_each
from loopserve.exit import ExitMode
from loopserve.models.family import LoopedModel
from loopserve.runner.attention.base import finalize_slots
from loopserve.runner.attention.prefix_groups import plan_prefix_groups
from loopserve.runner.attention.registry import make_attention_backend
from loopserve.runner.batch_invariant import row_by_row
from loopserve.runner.coda import Coda, CodaOutput, PendingLeave
from loopserve.runner.decode_rows import DecodeStep, FedBack
from loopserve.runner.eager_step import EagerStep
from loopserve.runner.exit_scores import ExitScores
from loopserve.runner.graphs import build_decode_graphs
from loopserve.runner.handles import HandleTable
from loopserve.runner.handoff_kv import HandoffKV
from loopserve.runner.logits_adjust import Matcher, TokenHistory, token_history
from loopserve.runner.loop_calls import LoopCalls
from loopserve.runner.options import RunnerOptions
from loopserve.runner.prompt_exits import PromptExits, refused_items
from loopserve.runner.runner_setup import (
    check_options,
    make_decode_slots,
    make_kv_cache,
    prepare_model,
)
from loopserve.runner.sampler import (
    is_greedy,
    make_generator,
    restore_generator,
)
from loopserve.runner.spec_criteria import SpecCriteria
from loopserve.runner.swap import InFlight, KVMoves
from loopserve.runner.transfers import Transfers
from loopserve.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)
# A request's sampling state: its spec, generator (None when greedy) and logits-adjustment
# history (None without adjustments).
Sampler = tuple[SampleSpec, torch.Generator | None, TokenHistory | None]


class ModelRunner(Executor):
    def __init__(
        self,
        model: LoopedModel,
        options: RunnerOptions,
        *,
        make_matcher: Callable[[StructuredOutput], Matcher] | None = None,
    ) -> None:
        """`options`: what it runs (`RunnerOptions`); `make_matcher`: a fresh grammar matcher
        for a request with structured output (the tokenizer's)."""
        check_options(model, options)
        prepare_model(model, options)
        self.model, self.options = model, options
        self.num_loops = model.num_loops
        self.block_size = options.block_size
        self.rules = StepRules.of(options.layout, self.num_loops, defers_leave=options.defers_leave)
        self.exit_mode = ExitMode(options.exit_mode)
        self.prompt_exits = options.prompt_exits
        self.per_request_prompt_loops = options.per_request_prompt_loops
        self.prompt_lens: dict[str, int] = {}
        self.block_tables = BlockTables()  # this executor's copy, kept from the steps' updates
        self.stable_steps: dict[str, int] = {}  # argmax-stability's steps per request
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.scale = model.config.head_dim**-0.5
        self.kv_cache = make_kv_cache(model, options, self.dtype, self.device)
        self.hazard_fn = self._hazard_fn()  # None: a criterion family has no hazard
        self.samplers: dict[str, Sampler] = {}
        self.make_matcher = make_matcher
        self.inflight: HandleTable[InFlight] = HandleTable()  # state between steps
        self._forward_s = 0.0  # this step's time inside model calls (prelude/core/gate/coda)
        self._num_finalized = 0  # this step's finalized decode tokens
        self.transfers = Transfers(self.device)  # every host<->device copy, counted
        # Swap space, hidden states of swapped-out requests, staged hand-off imports.
        self.moves = KVMoves(self.kv_cache, options.num_host_blocks, self.block_size,
                             self.inflight)  # fmt: skip
        self.attention = make_attention_backend(
            options.attention_backend, self.kv_cache, block_size=self.block_size,
            scale=self.scale, batch_invariant=options.batch_invariant,
            cascade=options.cascade_attention, transfers=self.transfers,
        )  # fmt: skip
        self.calls = LoopCalls(
            model, self.attention, num_planes=self.rules.num_planes, timed=self._timed,
            transfers=self.transfers, init_scale=options.init_scale,
            full_lookup=options.lookup == "full",
        )  # fmt: skip
        self.coda = Coda(
            rules=self.rules, exit_mode=self.exit_mode, coda=self.calls.leave,
            peek=self.calls.peek_leave if model.leave_writes_kv else None,
            hazards=self._timed_hazards(), samplers=self.samplers, transfers=self.transfers,
            inflight=self.inflight,
        )  # fmt: skip
        self.decode_slots = make_decode_slots(model, options, self.rules.num_planes, self.dtype,
                                              self.device)  # fmt: skip
        self.decode = DecodeStep(
            self.decode_slots, calls=self.calls, hazards=self._timed_hazards(),
            finalize=self._finalize_slots, transfers=self.transfers,
            num_planes=self.rules.num_planes, finalizes=options.lookup != "full",
        )  # fmt: skip
        self.eager = self._eager_step()
        self.graphs, self.graph_capture_error = self._graphs()
        # Prefill/decode hand-offs: K/V and state out of and into this runner.
        self.handoff = HandoffKV(self.moves, self.inflight, self.samplers, self.calls)

    # ---- builders (the constructor's parts) ---------------------------------------------

    def _hazard_fn(self):
        """The model's exit hazard over carried rows (the lookahead head's under
        `random_lookahead`; row by row when batch-invariant), or None for a criterion."""
        if self.model.signal_kind != "hazard":
            return None
        seed = self.options.lookahead_seed
        hazard_fn = self.model.hazard_fn(seed if self.exit_mode is ExitMode.RANDOM_LOOKAHEAD
                                         else None)  # fmt: skip
        return row_by_row(hazard_fn) if self.options.batch_invariant else hazard_fn

    def _timed_hazards(self):
        if self.hazard_fn is None:
            return None
        return lambda rows: self._timed(self.hazard_fn, rows)

    def _finalize_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.attention.finalize(src, dst)

    def _eager_step(self) -> EagerStep:
        options, criterion = self.options, self.decode_slots.criterion
        score_store = None
        if options.score_store:  # [slots, W]: prompt rows' last-loop outputs
            rows = options.num_blocks * options.block_size
            score_store = torch.zeros((rows, self.model.state_width), dtype=self.dtype,
                                      device=self.device)  # fmt: skip
        prompt_exits = None
        if options.prompt_exits and criterion is not None:
            prompt_exits = PromptExits(
                criterion=criterion.rule, calls=self.calls, finalize=self._finalize_exits,
                num_loops=self.num_loops, stable_steps=self.stable_steps,
            )  # fmt: skip
        spec_criteria = None  # a criterion family's speculative positions
        if criterion is not None:
            spec_criteria = SpecCriteria(criterion, self.calls, self.stable_steps)
            self.coda.exit_scores = ExitScores(criterion, self.calls, self.stable_steps)
        return EagerStep(
            calls=self.calls, hazards=self._timed_hazards(), attention=self.attention,
            decode=self.decode, coda=self.coda, transfers=self.transfers,
            inflight=self.inflight, rules=self.rules, block_size=options.block_size,
            finalize_exits=self._finalize_exits, score_store=score_store,
            prompt_exits=prompt_exits, spec_criteria=spec_criteria,
            keep_initial_states=criterion is not None,
        )  # fmt: skip

    def _graphs(self):
        """The decode graphs (None when off, or when capture failed: then the error). The
        graphed step calls the model's functions inside the capture (late-bound, so a
        replaced function is the one captured). Its leave runs in every call when the
        criterion reads logits, else in the calls with coda candidates (their greedy tokens
        come back with the step's signals) unless coda batching defers it."""
        options, model = self.options, self.model
        criterion = self.decode_slots.criterion
        return build_decode_graphs(
            options.graph_mode, model.loop, self.kv_cache, attention=self.attention,
            max_model_len=options.max_model_len or model.config.max_position_embeddings,
            prelude=lambda ids: model.enter(ids),
            enter=model.enter if model.config.extra_kv_planes else None,
            leave=model.leave, latent=model.latent,
            leave_always=criterion is not None and criterion.needs_logits,
            defers_leave=self.rules.defers_leave,
            hazards=(lambda rows: self.hazard_fn(rows)) if self.exit_mode.uses_gate else None,
            finalize=self._finalize_slots, slots=self.decode_slots, transfers=self.transfers,
            block_size=options.block_size, max_rows=options.max_num_seqs,
            dummy_block=options.num_blocks, scale=self.scale,
        )  # fmt: skip

    # ---- request bookkeeping ----------------------------------------------------------

    def _apply_bookkeeping(self, scheduled: SchedulerOutput) -> tuple[RequestFailure, ...]:
        """Drop released requests' state, set up new requests one by one; returns the new
        requests whose setup raised (none of their state is kept). The block tables' updates
        apply first (`BlockTables`)."""
        self.block_tables.apply(scheduled)
        for request_id in scheduled.finished_request_ids:
            self._drop_request(request_id)
        failures = set_up_each(scheduled.new_requests, self._install, self._drop_request, logger)
        for request_id, handle in scheduled.dropped_handles:  # rolled-back speculation
            self.inflight.drop(request_id, handle)
            self.coda.spec.drop(request_id, handle)
            self._drop_spec_criterion(request_id, handle)
        for transfer in scheduled.kv_transfers:  # in order: see `runner.swap`
            self.moves.apply(transfer, self.decode_slots)
        for request_id in scheduled.preempted_request_ids:
            self.inflight.release(request_id)  # recompute: hidden states go, the sampler stays
            self.decode_slots.release(request_id)
            self.coda.spec.drop(request_id)
            self._drop_spec_criterion(request_id)
        return failures

    def _install(self, new: NewRequestData) -> None:
        self.samplers[new.request_id] = self.setup_request(new)
        self.prompt_lens[new.request_id] = new.prompt_len
        criterion = self.decode_slots.criterion
        if criterion is not None and criterion.counts_steps:
            self.stable_steps[new.request_id] = new.stable_steps or criterion.default_steps
        staged = self.moves.staged_imports.get(new.request_id)
        self.calls.install(
            new.request_id, new.prompt_len, new.seed, None if staged is None else staged[2]
        )

    def setup_request(self, new: NewRequestData) -> Sampler:
        """Build one new request's per-request state (its sampler); the caller installs it
        only if this returns, so a setup that raises leaves nothing behind."""
        if (
            self.per_request_prompt_loops
            and self.rules.shared
            and 0 < new.max_loops < self.num_loops
        ):
            raise InvalidRequestError(
                "under the shared layout a request of this model runs the model's "
                f"{self.num_loops} loops; max_loops below it needs the last_exited layout"
            )
        greedy = is_greedy(new.sample_spec)
        generator = None if greedy else make_generator(new.seed, self.device)
        staged = self.moves.staged_imports.get(new.request_id)
        if generator is not None and staged is not None:  # continue the exporter's stream
            restore_generator(generator, staged[1])
        history = token_history(
            new, self.model.config.vocab_size, self.transfers, self.make_matcher
        )
        return new.sample_spec, generator, history

    def _drop_request(self, request_id: str) -> None:
        self.calls.drop(request_id)
        self.prompt_lens.pop(request_id, None)
        self.stable_steps.pop(request_id, None)
        self.decode_slots.release(request_id)
        self.samplers.pop(request_id, None)
        self.inflight.release(request_id)
        self.moves.drop(request_id)
        self.coda.spec.drop(request_id)
        self._drop_spec_criterion(request_id)

    def _drop_spec_criterion(self, request_id: str, handle: int | None = None) -> None:
        if self.eager.spec_criteria is not None:
            self.eager.spec_criteria.drop(request_id, handle)

    @property
    def num_live_handles(self) -> int:
        """Handles of work in flight plus decode slots held (requests decoding)."""
        return len(self.inflight) + len(self.decode_slots)

    @property
    def inflight_rows(self) -> int:
        return sum(state.hidden.shape[0] for state in self.inflight.states())

    # ---- execution ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        failures = self._apply_bookkeeping(scheduled)
        reasons = refused_items(
            scheduled.items, self.prompt_lens, prompt_exits=self.prompt_exits,
            scores_by_rule=self.hazard_fn is not None or self.coda.exit_scores is not None,
        )  # fmt: skip
        for failure in failures:
            reasons.pop(failure.request_id, None)
        if reasons:  # those requests fail alone, with the reason
            for request_id in reasons:
                self._drop_request(request_id)
            failures += tuple(
                RequestFailure(rid, f"InvalidRequestError: {reasons[rid]}")
                for rid in sorted(reasons)
            )
        if failures:
            return run_without_failed(scheduled, failures, self._run)
        return self._run(scheduled)

    def _run(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the step's decode rows and items (its bookkeeping is already applied): a
        decode-only call through the graphs when it fits, else eager core calls."""
        if scheduled.is_empty:
            return RunnerOutput(scheduled.step_id, ())
        start_s, self._forward_s = time.perf_counter(), 0.0
        self.transfers.discard_deferred()  # a failed step's leftovers, if any
        transfers0 = self.transfers.counts()
        self._num_finalized = 0
        graphs0 = self._graph_counts()
        tables, decode = self.block_tables.tables, scheduled.decode
        self.calls.begin_step(tables)
        if decode is not None and self.stable_steps:  # argmax-stability: steps per request
            steps = self.stable_steps
            column = np.fromiter((steps[r] for r in decode.request_ids), np.float64, len(decode))
            decode = dataclasses.replace(decode, threshold=column)
            scheduled = dataclasses.replace(scheduled, decode=decode)
        pending = fed = None
        if scheduled.leave is not None:  # held tokens: their leave and sampling first
            pending, fed = self._run_leave(scheduled.leave, decode)
        coda, rows_per_call = self._run_calls(scheduled, tables, fed)
        leave_results, leave_failed = None, ()
        if pending is not None:
            self.transfers.flush()  # read already when the step read anything else
            leave_results, leave_failed = pending.results()
        for item in scheduled.items:  # a prompt group's followers get the leader's prompt state
            forks = getattr(item, "forks", ())
            state = self.calls.export_state(item.request_id) if forks else None
            for request_id in forks if state else ():
                if request_id in self.samplers:
                    self.calls.restore(request_id, state)
        # No synchronize: the step's last copy to the host (sampled ids, hazards) waited for
        # the device already; a step without one leaves the device running ahead.
        stats = self._stats(
            rows_per_call, start_s, self._count_exits(coda, scheduled), transfers0, graphs0
        )
        return RunnerOutput(
            scheduled.step_id, tuple(coda.results), coda.failed + leave_failed, coda.decode,
            stats, leave_results,
        )  # fmt: skip

    def _run_calls(self, scheduled: SchedulerOutput, tables, fed: FedBack | None
                   ) -> tuple[CodaOutput, list[int]]:  # fmt: skip
        """The step's core calls and coda: none when only leave rows run, one graph replay
        for a decode-only call that fits a bucket (and no cascade group), else eager calls;
        (coda output, rows per core call)."""
        items, decode, graphs = scheduled.items, scheduled.decode, self.graphs
        if decode is None and not items:  # only leave rows this step
            return CodaOutput([], (), None), []
        groups = None  # cascade groups of a decode-only call, when cascade attention looked
        if decode is not None and not items and self.attention.cascade:
            segments = self.decode.segments(decode, tables)
            starts = [segment.start for segment in segments]
            groups = plan_prefix_groups([s.block_table for s in segments], starts, self.block_size)
        if (
            decode is not None
            and not items
            and not groups
            and graphs is not None
            and graphs.fits(len(decode), int(decode.positions.max()))
        ):  # the graphed decode step: one copy in, one replay
            host = self.decode.host_columns(decode, tables)
            bucket = graphs.stage(decode, host)
            if fed is not None:
                graphs.feed(bucket, fed)
            signals = self._timed(graphs.launch, bucket, decode, host)
            return self.coda((), [], [], [], [], signals), [len(decode)]
        coda, rows_per_call, self._num_finalized = self.eager.run(scheduled, tables, groups, fed)
        return coda, rows_per_call

    def _count_exits(self, coda: CodaOutput, scheduled: SchedulerOutput) -> int:
        """The step's tokens sampled below full depth (its early exits); adds the decode
        rows' LAST_EXITED finalize copies to `_num_finalized` and, under the `full` lookup,
        records where decode tokens exited."""
        num_early = sum(
            1 for r in coda.results if r.loops_used is not None and r.loops_used < self.num_loops
        )
        if coda.decode is None:
            return num_early
        decode = scheduled.decode
        assert decode is not None
        decode_exits = coda.decode.exited
        depths = decode.depths[decode_exits]  # of the exited rows: loops run - 1
        num_early += int(np.count_nonzero(depths < self.num_loops - 1))
        if self.rules.num_planes > 1 and not self.calls.full_lookup:
            self._num_finalized += int(np.count_nonzero(depths < self.rules.num_planes - 1))
        if self.calls.full_lookup:  # below-full exits hide their position from deeper loops
            loops = decode.depths + 1
            for row in decode_exits.nonzero()[0].tolist():  # host array
                rid = decode.request_ids[row]
                self.calls.ran(rid, [int(decode.positions[row])], int(loops[row]))
        return num_early

    def _graph_counts(self) -> tuple[int, int]:
        graphs = self.graphs
        return (0, 0) if graphs is None else (graphs.num_calls, graphs.num_padded_rows)

    def _stats(self, rows_per_call: list[int], start_s: float, num_early: int,
               transfers0: tuple, graphs0: tuple[int, int]) -> RunnerStats:  # fmt: skip
        """The step's telemetry: counters taken against their values at its start."""
        h2d, d2h, h2d_bytes, d2h_bytes = (
            now - before for now, before in zip(self.transfers.counts(), transfers0)
        )
        graph_calls, padded = (now - before for now, before in zip(self._graph_counts(), graphs0))
        return RunnerStats(
            tuple(rows_per_call),
            model_time_s=time.perf_counter() - start_s,
            forward_time_s=self._forward_s,
            num_early_exits=num_early,
            num_finalize_copies=self._num_finalized,
            num_graph_calls=graph_calls,
            num_padded_rows=padded,
            num_h2d_transfers=h2d,
            num_d2h_transfers=d2h,
            h2d_bytes=h2d_bytes,
            d2h_bytes=d2h_bytes,
        )

    def _run_leave(
        self, leave: LeaveRows, decode: DecodeRows | None
    ) -> tuple[PendingLeave, FedBack | None]:
        """The leave and sampling of held tokens (coda batching in time) from the carried
        state each kept in its decode slot since its exit, in one staged copy in (slots,
        positions, and which decode rows at loop 0 take which sampled token) and no copy
        out of its own: the tokens feed those rows on the device (`FedBack`) and their read
        rides along with the step's."""
        slot_of = self.decode_slots.slot_of
        missing = [rid for rid in leave.request_ids if rid not in slot_of]
        if missing:
            raise RuntimeError(f"leave rows of requests without a decode slot: {missing}")
        m = len(leave)
        slots = np.fromiter((slot_of[rid] for rid in leave.request_ids), np.int64, m)
        ahead = np.zeros(0, np.int64) if decode is None else (decode.token_ids < 0).nonzero()[0]
        sources = np.zeros(0, np.int64)
        if len(ahead):
            where = {rid: i for i, rid in enumerate(leave.request_ids)}
            ids = decode.request_ids  # type: ignore[union-attr]
            rows = ahead.tolist()  # host array
            sources = np.fromiter((where[ids[row]] for row in rows), np.int64, len(rows))
        parts = [slots, leave.positions, ahead, sources]
        staged = self.transfers.to_device(np.concatenate(parts))
        slots_t, positions_t, ahead_t, sources_t = staged.split([len(p) for p in parts])
        carried = self.decode_slots.hidden.index_select(0, slots_t)
        pending = self.coda.leave_rows(leave, carried, positions_t)
        fed = None
        if len(ahead):
            fed = FedBack(ahead, ahead_t, pending.tokens.index_select(0, sources_t))
        return pending, fed

    def _finalize_exits(self, exits) -> int:
        """LAST_EXITED copies of tokens exiting below full depth (`exits`: (block tables,
        position, exit depth) each); none under SHARED or the `full` lookup. Returns how
        many tokens."""
        if self.rules.shared or self.calls.full_lookup:
            return 0
        src, dst = finalize_slots(exits, self.block_size, self.rules.num_planes)
        if src:
            slots = self.transfers.to_device(src + dst)
            self.attention.finalize(slots[: len(src)], slots[len(src) :])
        return sum(1 for _, _, depth in exits if depth < self.num_loops - 1)

    def _timed(self, fn, *args) -> torch.Tensor:
        """Call a model function, adding its duration to this step's forward time.

        On CUDA this counts launch time only (no synchronize per call), so the host share it
        implies is an upper bound there; on CPU it is the op time itself."""
        start_s = time.perf_counter()
        out = fn(*args)
        self._forward_s += time.perf_counter() - start_s
        return out
