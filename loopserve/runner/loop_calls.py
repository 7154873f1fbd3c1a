"""The model's math as the runner calls it: enter, loop, leave and the exit signal of any
family (`models/family.py`, `LoopedModel`), with what those calls need from the runner.

- Once planes: a family whose prelude and coda keep K/V once per position (Huginn) gets, for
  every `enter` and `leave`, one prepared attention call per once plane over the rows' spans
  (`Span`: request, first position, count; the block tables are the step's). A family without
  once planes (Ouro) gets nothing prepared and no positions copied.
- Drawn initial states (`init_scale` > 0): each request's draws from its own seed, the
  prompt's block at its first chunk and one row per generated position, kept per position so
  a recomputed position gets the same draw (`Latents`).
- The `full` lookup (the Huginn authors' default): a one-row call does not attend to earlier
  positions that did not run the loop it runs; `steps_run` records, per request, the loops
  each position ran when it exited below the full depth (positions not recorded ran every
  loop).
- The criterion state of tokens in flight (`CriterionSlots`): per decode slot, the
  criterion's fields, on the device, checked on the loops the plan lets it decide.

Every call is timed into the step's forward time (`timed`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from loopserve.exit.criteria import ExitCriterion, make_criterion
from loopserve.runner.attention.base import PagedAttentionBackend, RowSegment
from loopserve.runner.attention.peek import PeekAttention
from loopserve.runner.transfers import Transfers

Span = tuple[str, int, int]  # (request id, first position, count): rows of one request


class Latents:
    """A request's random initial states: its generator, the prompt's block (drawn whole at
    the first chunk) and each generated position's row."""

    __slots__ = ("generator", "prompt_len", "prompt", "drawn")

    def __init__(self, generator: torch.Generator, prompt_len: int) -> None:
        self.generator, self.prompt_len = generator, prompt_len
        self.prompt: torch.Tensor | None = None
        self.drawn: dict[int, torch.Tensor] = {}

    def rows(self, start: int, count: int, draw) -> torch.Tensor:
        """Initial states of positions [start, start + count); `draw(rows)` draws new ones
        from this request's generator."""
        if start < self.prompt_len:
            if self.prompt is None:
                self.prompt = draw(self.prompt_len)
            return self.prompt[start : start + count]
        assert count == 1, "generated positions start one at a time"
        if start not in self.drawn:
            self.drawn[start] = draw(1)
        return self.drawn[start]


class LoopCalls:
    """Explicit inputs: the model, the attention backend, the number of loop planes (once
    planes follow them), the timed-call wrapper, the transfer counter, the initial-state
    scale and whether the `full` lookup runs."""

    def __init__(
        self,
        model,
        attention: PagedAttentionBackend,
        *,
        num_planes: int,
        timed: Callable,
        transfers: Transfers,
        init_scale: float = 0.0,
        full_lookup: bool = False,
    ) -> None:
        self.model = model
        self.attention = attention
        self.once_planes = range(num_planes, num_planes + model.config.extra_kv_planes)
        self.needs_context = len(self.once_planes) > 0  # enter/leave read positions and K/V
        self.timed = timed
        self.transfers = transfers
        self.init_scale = init_scale
        self.full_lookup = full_lookup
        self.tables: dict = {}  # this step's block tables (`begin_step`)
        self.latents: dict[str, Latents] = {}
        self.steps_run: dict[str, dict[int, int]] = {}

    def begin_step(self, block_tables) -> None:
        self.tables = block_tables

    # ---- per request ------------------------------------------------------------------

    def install(self, request_id: str, prompt_len: int, seed: int | None, state) -> None:
        """A new request: its runner state from a hand-off (`export_state`), or fresh draws
        from its seed when initial states are drawn."""
        if state:
            self.restore(request_id, state)
        elif self.init_scale > 0:
            seed = seed if seed is not None else random.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
            self.latents[request_id] = Latents(generator, prompt_len)

    def drop(self, request_id: str) -> None:
        self.latents.pop(request_id, None)
        self.steps_run.pop(request_id, None)

    def export_state(self, request_id: str) -> dict | None:
        """What the runner keeps of a request between tokens besides K/V, its sampler and
        its decode slot: its drawn initial states (generator state, the prompt's block, each
        generated position's row) and the `full` lookup's record. CPU tensors and plain
        values (it travels pickled); None when it keeps nothing."""
        state: dict = {}
        if request_id in self.steps_run:
            state["steps_run"] = dict(self.steps_run[request_id])
        latents = self.latents.get(request_id)
        if latents is not None:
            state["latents"] = {
                "generator": latents.generator.get_state(),
                "prompt_len": latents.prompt_len,
                "prompt": None if latents.prompt is None else latents.prompt.cpu(),
                "drawn": {p: row.cpu() for p, row in latents.drawn.items()},
            }
        return state or None

    def restore(self, request_id: str, state: dict) -> None:
        if state.get("steps_run"):
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

    # ---- the `full` lookup --------------------------------------------------------------

    def hidden(self, request_id: str, position: int, loop: int) -> tuple[int, ...]:
        """Earlier positions a one-row call at `loop` may not attend (`full` lookup only)."""
        if not self.full_lookup:
            return ()
        steps = self.steps_run.get(request_id, {})
        return tuple(p for p, ran in steps.items() if p < position and ran <= loop)

    def ran(self, request_id: str, positions, loops: int) -> None:
        """Positions that exited after `loops` loops (recorded under the `full` lookup)."""
        if self.full_lookup:
            table = self.steps_run.setdefault(request_id, {})
            for position in positions:
                table[position] = loops

    # ---- the math -----------------------------------------------------------------------

    def once(self, spans: Sequence[Span]) -> list:
        return [
            self.attention.prepare(
                [RowSegment(self.tables[rid][plane], start, count) for rid, start, count in spans]
            )
            for plane in self.once_planes
        ]

    def _context(self, spans, positions):
        """(where the rows are, their positions on the device) for a call that reads them
        (`positions()`: on the device already, when the caller has them)."""
        where = spans()
        positions = None if positions is None else positions()
        if positions is None:
            positions = self.transfers.to_device(
                [p for _, start, count in where for p in range(start, start + count)]
            )
        return where, positions

    def enter(
        self,
        token_ids: torch.Tensor,
        spans: Callable[[], Sequence[Span]],
        positions: Callable[[], torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """The carried state of rows that start (`spans()`: where they are, and
        `positions()`: their positions on the device or None, read only by a family with
        once planes or drawn initial states)."""
        if not self.needs_context and self.init_scale <= 0:
            return self.timed(self.model.enter, token_ids)
        where, positions = self._context(spans, positions)
        initial = None
        if self.init_scale > 0:
            rows = [self.initial_rows(rid, start, count) for rid, start, count in where]
            initial = torch.cat(rows)
        return self.timed(self.model.enter, token_ids, positions, self.once(where), initial)

    def initial_rows(self, request_id: str, start: int, count: int) -> torch.Tensor:
        """Drawn initial states of positions [start, start + count) of a request."""
        latents = self.latents[request_id]
        return latents.rows(start, count, lambda rows: self._draw(rows, latents.generator))

    def _draw(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        """`rows` random initial states from a request's generator (the authors' draws)."""
        param = self.model.lm_head.weight
        blank = torch.empty(rows, self.model.config.hidden_size, dtype=param.dtype)
        return self.model.initial_state(blank, init_scale=self.init_scale, generator=generator)

    def loop(self, carried: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        return self.timed(self.model.loop, carried, positions, attn)

    def leave(
        self,
        carried: torch.Tensor,
        spans: Callable[[], Sequence[Span]],
        positions: Callable[[], torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Logits of carried rows (`spans()`: where they are, and `positions()`: their
        positions on the device or None, asked only by a family with once planes)."""
        if not self.needs_context:
            return self.timed(self.model.leave, carried)
        where, positions = self._context(spans, positions)
        return self.timed(self.model.leave, carried, positions, self.once(where))

    def peek_leave(self, carried: torch.Tensor, request_id: str, positions: list[int]):
        """Logits of rows of one request at `positions` whose leave attends to the stored K/V
        of earlier positions and to its own of this call, and writes no K/V
        (`attention/peek.py`); a family whose leave reads no positions runs it as is."""
        if not self.needs_context:
            return self.timed(self.model.leave, carried)
        tables, attention = self.tables[request_id], self.attention
        once = [
            PeekAttention(
                attention.kv_cache,
                [tables[plane]] * len(positions),
                positions,
                attention.block_size,
                attention.scale,
            )  # fmt: skip
            for plane in self.once_planes
        ]
        return self.timed(self.model.leave, carried, self.transfers.to_device(positions), once)


class CriterionSlots:
    """The criterion of decode tokens in flight: its fields per decode slot on the device
    (allocated at the first token, shaped like the criterion's own), one check over a call's
    rows. Every criterion takes a per-row threshold: each request's `exit_threshold`, or for
    argmax-stability its stable steps (`SamplingParams.exit_stable_steps`; `threshold`, the
    engine's, or the authors' 2 when a request names none)."""

    def __init__(self, name: str, *, vocab_size: int, threshold: float | None, capacity: int):
        self.name, self.vocab_size, self.threshold = name, vocab_size, threshold
        self.capacity = capacity
        self.fields: dict[str, torch.Tensor] = {}
        probe = self.rule()
        self.state_fields = probe.state_fields
        self.needs_logits = probe.needs_logits
        # argmax-stability's threshold is a step count: the runner passes each request's
        # (`stable_steps`) in the rows' threshold column, as it passes every other
        # criterion's request threshold.
        self.counts_steps = probe.name == "argmax-stability"
        self.default_steps = int(probe.threshold)
        self.per_request_threshold = True

    def rule(self) -> ExitCriterion:
        return make_criterion(self.name, vocab_size=self.vocab_size, threshold=self.threshold)

    def _store(self, rule: ExitCriterion, slots: torch.Tensor) -> None:
        for name in self.state_fields:
            value = getattr(rule, name)
            if name not in self.fields:
                shape = (self.capacity + 1, *value.shape[1:])
                self.fields[name] = torch.zeros(shape, dtype=value.dtype, device=value.device)
            self.fields[name].index_copy_(0, slots, value.to(self.fields[name].dtype))

    def start(self, slots: torch.Tensor, initial_latents: torch.Tensor) -> None:
        """Tokens that start: their criterion from their initial state [n, H]."""
        rule = self.rule()
        rule.init(initial_latents.unsqueeze(1))
        self._store(rule, slots)

    def check(
        self,
        slots: torch.Tensor,
        latents: torch.Tensor,
        logits: torch.Tensor | None,
        thresholds: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One check of the tokens in `slots` after this loop: (fires bool [n], scores
        float64 [n]); their fields move on."""
        rule = self.rule()
        for name in self.state_fields:
            setattr(rule, name, self.fields[name].index_select(0, slots))
        if self.per_request_threshold and thresholds is not None:
            rule.threshold = thresholds
        fires, values = rule.check(latents.unsqueeze(1), logits)
        self._store(rule, slots)
        return fires, values.double()

    def check_rows(
        self,
        slots: torch.Tensor,
        initial_latents: torch.Tensor,
        starts: torch.Tensor,
        latents: torch.Tensor,
        logits: torch.Tensor | None,
        thresholds: torch.Tensor,
        checked: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same over every row of a fixed-shape call (the decode graphs): rows that start
        (`starts`) take the criterion of their initial latents, only `checked` rows are
        checked and move their fields on. Returns (scores float64, NaN where unchecked;
        fires bool, False where unchecked)."""
        fresh = self.rule()
        fresh.init(initial_latents.unsqueeze(1))
        rule = self.rule()
        before = {}
        for name in self.state_fields:
            value = getattr(fresh, name)
            if name not in self.fields:  # first call (a graph's warm-up, before capture)
                shape = (self.capacity + 1, *value.shape[1:])
                self.fields[name] = torch.zeros(shape, dtype=value.dtype, device=value.device)
            stored = self.fields[name].index_select(0, slots)
            before[name] = torch.where(_rows(starts, value), value.to(stored.dtype), stored)
            setattr(rule, name, before[name])
        if self.per_request_threshold:
            rule.threshold = thresholds
        fires, values = rule.check(latents.unsqueeze(1), logits)
        for name in self.state_fields:
            after = getattr(rule, name).to(before[name].dtype)
            self.fields[name].index_copy_(
                0, slots, torch.where(_rows(checked, after), after, before[name])
            )
        nan = torch.full_like(values, float("nan"), dtype=torch.float64)
        return torch.where(checked, values.double(), nan), fires & checked

    def take(self, slot: int) -> dict[str, torch.Tensor]:
        return {name: field[slot].clone() for name, field in self.fields.items()}

    def put(self, slot: int, saved: dict[str, torch.Tensor]) -> None:
        for name, value in saved.items():
            self.fields[name][slot].copy_(value)


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row mask shaped to broadcast over `like`'s trailing dimensions."""
    return mask.view(-1, *([1] * (like.dim() - 1)))
