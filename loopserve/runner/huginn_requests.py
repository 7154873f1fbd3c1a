"""The per-request state of the Huginn executor (`runner/huginn_runner.py`): samplers, each
request's r, its random initial states, the steps each position ran (the `full` lookup), the
decode token in flight, paused prompt and replay work under its handles, what a swap-out
set aside and handed-off requests waiting for admission. `HuginnRequests` sets requests up
(each failing alone), drops them, moves their paused work with swaps, and exports and
restores what a prefill/decode hand-off carries."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import torch

from loopserve.contracts import (
    KVTransfer,
    NewRequestData,
    RequestFailure,
    SampledToken,
    SchedulerOutput,
    SwapKind,
)
from loopserve.errors import InvalidRequestError
from loopserve.execution import set_up_each
from loopserve.runner.handles import HandleTable
from loopserve.runner.huginn_parts import DecodeToken, Latents
from loopserve.runner.sampler import (
    is_greedy,
    make_generator,
    restore_generator,
    sample_rows,
    token_history,
)
from loopserve.runner.swap import SwapSpace
from loopserve.runner.transfers import Transfers

logger = logging.getLogger(__name__)


class HuginnRequests:
    """Inputs: the model's r, the layout (SHARED?), the vocabulary size, the device and its
    transfer counter, the swap space, a grammar matcher factory (None without a tokenizer),
    the lookup (`full`), the initial-state scale and `draw(rows, generator)`."""

    def __init__(
        self,
        *,
        num_loops: int,
        shared: bool,
        vocab_size: int,
        device: torch.device,
        transfers: Transfers,
        swap: SwapSpace,
        make_matcher: Callable | None,
        full: bool,
        init_scale: float,
        draw: Callable[[int, torch.Generator], torch.Tensor],
    ) -> None:
        self.num_loops, self.shared, self.vocab_size = num_loops, shared, vocab_size
        self.device, self.transfers, self.swap = device, transfers, swap
        self.make_matcher, self.full, self.init_scale, self.draw = (
            make_matcher,
            full,
            init_scale,
            draw,
        )
        self.samplers: dict[str, tuple] = {}
        self.max_loops: dict[str, int] = {}  # per request: its r
        self.prompt_lens: dict[str, int] = {}
        self.latents: dict[str, Latents] = {}  # with init_scale > 0
        self.steps_run: dict[str, dict[int, int]] = {}  # request -> position -> steps
        self.decoding: dict[str, DecodeToken] = {}
        # Prompt and replay work between steps: (state, e, state at the request's last loop).
        self.inflight: HandleTable[tuple] = HandleTable()
        self.swapped: dict[str, tuple[dict, DecodeToken | None]] = {}
        # Handed-off requests not yet admitted: request_id -> (K/V blocks, generator state,
        # runner state from `export_state`).
        self.staged_imports: dict[str, tuple[torch.Tensor, bytes | None, dict | None]] = {}

    def setup_request(self, new: NewRequestData) -> tuple:
        if self.shared and 0 < new.max_loops < self.num_loops:
            raise InvalidRequestError(
                "under the shared layout a Huginn request runs the model's r steps "
                f"({self.num_loops}); max_loops below it needs the last_exited layout"
            )
        generator = None if is_greedy(new.sample_spec) else make_generator(new.seed, self.device)
        staged = self.staged_imports.get(new.request_id)
        if generator is not None and staged is not None:  # continue the exporter's stream
            restore_generator(generator, staged[1])
        history = token_history(new, self.vocab_size, self.transfers, self.make_matcher)
        return new.sample_spec, generator, history

    def drop(self, request_id: str) -> None:
        self.samplers.pop(request_id, None)
        self.max_loops.pop(request_id, None)
        self.prompt_lens.pop(request_id, None)
        self.latents.pop(request_id, None)
        self.steps_run.pop(request_id, None)
        self.swapped.pop(request_id, None)
        self.staged_imports.pop(request_id, None)
        self.decoding.pop(request_id, None)
        self.inflight.release(request_id)

    def bookkeeping(self, scheduled: SchedulerOutput) -> tuple[RequestFailure, ...]:
        for request_id in scheduled.finished_request_ids:
            self.drop(request_id)
        failures = set_up_each(scheduled.new_requests, self._install, self.drop, logger)
        for transfer in scheduled.kv_transfers:  # in order, before the step's calls
            self.move(transfer)
        for request_id in scheduled.preempted_request_ids:
            self.inflight.release(request_id)
            self.decoding.pop(request_id, None)
        return failures

    def _install(self, new: NewRequestData) -> None:
        self.samplers[new.request_id] = self.setup_request(new)
        self.max_loops[new.request_id] = new.max_loops or self.num_loops
        self.prompt_lens[new.request_id] = new.prompt_len
        staged = self.staged_imports.get(new.request_id)
        if staged is not None and staged[2] is not None:  # a hand-off: the exporter's state
            self._restore(new.request_id, staged[2])
        elif self.init_scale > 0:
            seed = new.seed if new.seed is not None else random.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
            self.latents[new.request_id] = Latents(generator, new.prompt_len)

    # ---- hand-off (prefill/decode disaggregation) ---------------------------------------

    def export_state(self, request_id: str) -> dict:
        """What this executor keeps of a request between tokens, besides K/V and sampler:
        its random initial states (generator state, the prompt's block, each generated
        position's row) and, under the `full` lookup, the steps each position ran. CPU
        tensors and plain values (it travels pickled)."""
        state: dict = {"steps_run": dict(self.steps_run.get(request_id, {}))}
        latents = self.latents.get(request_id)
        if latents is not None:
            state["latents"] = {
                "generator": latents.generator.get_state(),
                "prompt_len": latents.prompt_len,
                "prompt": None if latents.prompt is None else latents.prompt.cpu(),
                "drawn": {p: row.cpu() for p, row in latents.drawn.items()},
            }
        return state

    def _restore(self, request_id: str, state: dict) -> None:
        if state["steps_run"]:
            self.steps_run[request_id] = dict(state["steps_run"])
        saved = state.get("latents")
        if saved is None:
            return
        generator = torch.Generator()
        generator.set_state(saved["generator"])
        latents = Latents(generator, saved["prompt_len"])
        latents.prompt = saved["prompt"]
        latents.drawn = dict(saved["drawn"])
        self.latents[request_id] = latents

    def move(self, transfer: KVTransfer) -> None:
        request_id = transfer.request_id
        if transfer.kind is SwapKind.IMPORT:  # a handed-off request's blocks, every plane
            kv = self.staged_imports.pop(request_id)[0]
            self.swap.import_blocks(kv, transfer)
            return
        self.swap.copy(transfer)
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

    def hidden(self, request_id: str, position: int, step: int) -> tuple[int, ...]:
        """Earlier positions that did not run step `step` (lookup "full")."""
        steps = self.steps_run.get(request_id, {})  # positions not in it ran every step
        return tuple(p for p, ran in steps.items() if p < position and ran <= step)

    def ran(self, request_id: str, positions, steps: int) -> None:
        if self.full:
            table = self.steps_run.setdefault(request_id, {})
            for position in positions:
                table[position] = steps

    def initial_rows(self, request_id: str, start: int, count: int) -> torch.Tensor:
        """Initial states of positions [start, start + count) of a request (`init_scale` >
        0): the authors' draws from its seed, kept per position."""
        latents = self.latents[request_id]
        return latents.rows(start, count, lambda rows: self.draw(rows, latents.generator))

    def sample(self, logits, request_ids, failed) -> list[SampledToken | None]:
        """One token per row from its request's sampler; a request whose sampling raises gets
        None and a `RequestFailure` in `failed` (it fails alone)."""
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
