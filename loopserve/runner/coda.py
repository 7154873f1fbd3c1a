"""The end of a step in the model runner: coda and sampling of the exiting rows, each item's
result (its hidden state kept for the next step or released) and the decode rows' results.

Rows exit in two ways: a decode row whose loop exits (its output goes to the coda), and a
request's last prompt chunk reaching the last depth (the first token's exit is chosen from
the last position's D hazards, `choose_exit_from_hazards`, and that loop's output goes to the
coda). One coda call and one sampling pass serve them all; a row whose sampling raises fails
its request alone.

Decode rows are sampled from their coda candidates (`runner/decode_rows.py`): rows whose exit
is certain, and rows whose gate decides on the device. When every candidate samples greedily
(no generator advances), all candidates are sampled at once and the exit flags, hazards and
tokens come back in one copy; rows that turn out not to exit drop their token. Otherwise (a
gate-decided candidate that samples with a generator) the exit flags are read first, and the
candidates that do not exit are sampled greedily (their generators must not advance) and
dropped: a second copy out, none more in.

A family whose leave writes K/V (Huginn) has already run the leave of its completed prompt
chunks over all their rows (`EagerStep`): those logits (`completed`) sample the first token
and score the prompt here, with the loops a prompt exit chose when it exited as one token.
The leave reads where its rows are (`Span`s, built only for a family with once planes).

Three parts of a step's end have rooms of their own, called from here: prompt logprobs
(`runner/prompt_scores.py`), speculative rows' tokens and drafts (`runner/spec_samples.py`),
and the decode rows' read and results (`runner/decode_reads.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from loopserve.contracts import (
    DecodeResults,
    ItemKind,
    ItemResult,
    LeaveRows,
    RequestFailure,
    SampledToken,
    SampleSpec,
)
from loopserve.execution import StepRules
from loopserve.exit import ExitMode, choose_exit_from_hazards
from loopserve.runner.decode_reads import (
    DecodeRead,
    DecodeSampled,
    PendingLeave,
    decode_results,
    greedy_results,
)
from loopserve.runner.decode_rows import DecodeSignals, decode_spans
from loopserve.runner.exit_scores import ExitScores
from loopserve.runner.handles import HandleTable
from loopserve.runner.prompt_scores import PromptScores
from loopserve.runner.sampler import (
    is_greedy,
    read_samples,
    sample_on_device,
    sampling_failure,
)
from loopserve.runner.spec_samples import SpecSamples
from loopserve.runner.swap import InFlight
from loopserve.runner.transfers import Transfers

# A candidate that does not exit: greedy, no generator, no history (its token is dropped).
HELD = (SampleSpec(temperature=0.0), None, None)


class _DecodeBatch(NamedTuple):
    """A step's decode coda candidates (`Coda._decode_candidates`)."""

    read: DecodeRead
    candidates: list[int]  # rows
    rows: torch.Tensor | None  # their outputs [c, H] (None: none, or the step ran their leave)
    samplers: list[tuple]  # their (spec, generator, history), `HELD` for one known to stay
    has_history: bool  # some candidate's sampling reads its tokens
    # Every candidate takes the argmax, which the graphed step read with its signals
    # (`DecodeSignals.greedy`): nothing is sampled.
    greedy: bool = False


def takes_argmax(sampler: tuple) -> bool:
    """A request whose token is its logits' argmax as they are: greedy, no log-probabilities,
    no logits adjustment."""
    spec, _, history = sampler
    return history is None and spec.num_logprobs is None and is_greedy(spec)


def _candidate_positions(decode: DecodeSignals, batch: _DecodeBatch) -> torch.Tensor | None:
    """The decode candidates' positions on the device (eager calls), or None."""
    if decode.positions is None:
        return None
    return decode.positions.index_select(0, decode.candidates_on_device[: len(batch.candidates)])


class CodaOutput(NamedTuple):
    results: list[ItemResult]
    failed: tuple[RequestFailure, ...]  # requests whose sampling raised
    decode: DecodeResults | None


class Coda:
    """Explicit inputs: the step rules, the exit mode, the (timed) coda and exit-signal
    functions, the per-request samplers, the transfer counter and the in-flight handle
    table."""

    def __init__(
        self,
        *,
        rules: StepRules,
        exit_mode: ExitMode,
        coda: Callable[..., torch.Tensor],
        peek: Callable[..., torch.Tensor] | None = None,
        hazards: Callable[[torch.Tensor], torch.Tensor],
        samplers: dict,
        transfers: Transfers,
        inflight: HandleTable[InFlight],
    ) -> None:
        self.rules = rules
        self.exit_mode = exit_mode
        self.coda = coda
        # A criterion family's pick of prompt rows at their exit loops (the runner sets it).
        self.exit_scores: ExitScores | None = None
        self.samplers = samplers
        self.transfers = transfers
        self.inflight = inflight
        self.spec = SpecSamples(coda=coda, samplers=samplers, transfers=transfers)
        # A family whose leave writes K/V: its leave that writes none (`peek`,
        # `LoopCalls.peek_leave`), for cached positions scored again from the score store.
        self.prompt_scores = PromptScores(
            num_loops=rules.num_loops, coda=coda, peek=peek, hazards=hazards, transfers=transfers
        )

    def __call__(
        self,
        items,
        states,
        hazards,
        last_outputs,
        exited,
        decode: DecodeSignals | None = None,
        cached_rows: dict[int, torch.Tensor] | None = None,
        completed: dict[int, tuple[torch.Tensor, int | None]] | None = None,
    ) -> CodaOutput:
        """Coda and sampling of the exiting rows; the items' results, the requests whose
        sampling raised (each fails alone) and the decode rows' results. `completed`: items
        whose leave already ran (logits of all rows, and the loops of a prompt exit)."""
        if not items and decode is not None:
            return self.decode_only(decode)
        completed = completed or {}
        scores = self.prompt_scores(
            items, states, last_outputs, cached_rows or {}, completed, self.exit_scores
        )
        coda_rows: list[torch.Tensor] = []
        spans: list[tuple[str, int, int]] = []  # where the coda rows are
        # Per coda row: (a decode row?, its index), and its request's (spec, generator).
        owners: list[tuple[bool, int]] = []
        pairs: list[tuple] = []
        batch = None if decode is None else self._decode_candidates(decode)
        positions = None  # the coda rows' positions on the device, when only decode rows
        computed = []  # the decode candidates' logits when the call computed them
        if batch is not None and batch.rows is not None:
            owners += [(True, row) for row in batch.candidates]
            pairs += batch.samplers
            if decode.logits is not None:  # type: ignore[union-attr]
                computed.append(decode.logits)  # type: ignore[union-attr]
            else:
                coda_rows.append(batch.rows)
                spans += decode_spans(decode.rows, batch.candidates)  # type: ignore[union-attr]
                positions = functools.partial(_candidate_positions, decode, batch)
        first_tokens = [
            self.rules.samples_first_token(item) or completed.get(i, (None, None))[1] is not None
            for i, item in enumerate(items)
        ]
        if any(first_tokens):
            self.transfers.flush()  # the first token's exit is chosen from its hazards
        loops_used: dict[int, int] = {}
        ready: list[torch.Tensor] = []  # logits of first tokens whose leave already ran
        ready_owners: list[tuple[bool, int]] = []
        ready_pairs: list[tuple] = []
        for i, item in enumerate(items):
            if first_tokens[i]:
                assert item.exit_rule is not None
                logits, exit_loops = completed.get(i, (None, None))
                loops = exit_loops or choose_exit_from_hazards(
                    self.exit_mode, item.exit_rule, hazards[i] or None, item.trace_loops
                )
                if logits is not None:
                    ready.append(logits[-1:])
                    ready_owners.append((False, i))
                    ready_pairs.append(self.samplers[item.request_id])
                else:
                    coda_rows.append(last_outputs[i][loops - 1][-1:])
                    positions = None
                    owners.append((False, i))
                    pairs.append(self.samplers[item.request_id])
                    spans.append((item.request_id, item.token_start + item.token_count - 1, 1))
                loops_used[i] = loops
        sampled: dict[int, SampledToken] = {}
        forked: dict[int, dict[str, SampledToken | None]] = {}  # item -> its forks' tokens
        decode_sampled = DecodeSampled([], [], {})
        failed: list[RequestFailure] = []
        if coda_rows or ready or computed:
            parts = [self.coda(torch.cat(coda_rows), lambda: spans, positions)] if coda_rows else []
            parts = computed + parts
            owners += ready_owners
            pairs += ready_pairs
            logits = torch.cat(parts + ready)
            # A prompt group's followers sample from their leader's first-token row.
            forks = [
                (row, index, request_id)
                for row, (is_decode, index) in enumerate(owners)
                if not is_decode
                for request_id in items[index].forks
                if request_id in self.samplers  # (a follower whose setup failed has none)
            ]
            if forks:
                source = self.transfers.to_device([row for row, _, _ in forks])
                logits = torch.cat([logits, logits.index_select(0, source)])
                pairs += [self.samplers[request_id] for _, _, request_id in forks]
            token_ids, with_logprobs, failures = self._sample_logits(logits, pairs)
            for k, (_, index, request_id) in enumerate(forks):
                row = len(owners) + k
                if row in failures:
                    failed.append(sampling_failure(request_id, failures[row]))
                    forked.setdefault(index, {})[request_id] = None
                    continue
                token = with_logprobs.get(row) or SampledToken(token_ids[row])
                forked.setdefault(index, {})[request_id] = token
                self._record(request_id, token_ids[row])
            request_ids = [
                decode.rows.request_ids[index] if is_decode else items[index].request_id  # type: ignore[union-attr]
                for is_decode, index in owners
            ]
            for row, ((is_decode, index), token_id) in enumerate(zip(owners, token_ids)):
                if row in failures:  # this request fails alone; the call's other rows go on
                    failed.append(sampling_failure(request_ids[row], failures[row]))
                elif is_decode:
                    decode_sampled.rows.append(index)
                    decode_sampled.token_ids.append(token_id)
                    if row in with_logprobs:
                        decode_sampled.logprobs[index] = with_logprobs[row]
                else:
                    sampled[index] = with_logprobs.get(row) or SampledToken(token_id)
                    self._record(request_ids[row], token_id)
        spec_sampled, spec_failed = self.spec(items, states, exited)
        sampled.update(spec_sampled)
        failed += spec_failed
        self.transfers.flush()  # hazards and exits not read yet (no coda this step)
        results = self._item_results(items, states, hazards, last_outputs, exited, sampled)
        for i, result in enumerate(results):
            if i in scores or i in loops_used:
                results[i] = result._replace(
                    loops_used=loops_used.get(i), prompt_logprobs=scores.get(i, ())
                )
            if i in forked:
                tokens = forked[i]
                results[i] = results[i]._replace(
                    forked=tuple(tokens.get(request_id) for request_id in items[i].forks)
                )
        decoded = None
        if batch is not None:
            decoded = decode_results(batch.read, decode_sampled)
            if batch.has_history:
                self._record_decode(decode.rows.request_ids, decoded.token_ids)  # type: ignore[union-attr]
        return CodaOutput(results, tuple(failed), decoded)

    def decode_only(self, decode: DecodeSignals) -> CodaOutput:
        """A step of decode rows only (the graphed step): their candidates' coda, sampling and
        results, with one read of the device when the candidates allow it."""
        batch = self._decode_candidates(decode)
        sampled = DecodeSampled([], [], {})
        failed: tuple[RequestFailure, ...] = ()
        if batch.greedy:  # the step's argmax, read with its signals
            self.transfers.flush()
            return CodaOutput([], failed, greedy_results(batch.read))
        if batch.candidates:
            logits = self._decode_logits(decode, batch)
            token_ids, with_logprobs, failures = self._sample_logits(logits, batch.samplers)
            candidates = batch.candidates
            logprobs = {candidates[j]: token for j, token in with_logprobs.items()}
            sampled = DecodeSampled(candidates, token_ids, logprobs)
            ids = decode.rows.request_ids
            failed = tuple(
                sampling_failure(ids[candidates[j]], error) for j, error in failures.items()
            )
        else:
            self.transfers.flush()  # exits and hazards not read yet (nothing sampled)
        results = decode_results(batch.read, sampled)
        if batch.has_history:
            self._record_decode(decode.rows.request_ids, results.token_ids)
        return CodaOutput([], failed, results)

    def _decode_logits(self, decode: DecodeSignals, batch: _DecodeBatch) -> torch.Tensor:
        """The decode candidates' logits: computed by the call already, or their leave."""
        if decode.logits is not None:
            return decode.logits
        if decode.row_logits is not None:  # the graphed step ran every row's leave
            index = decode.candidates_on_device[: len(batch.candidates)]
            return decode.row_logits.index_select(0, index)
        return self.coda(
            batch.rows,
            lambda: decode_spans(decode.rows, batch.candidates),
            lambda: _candidate_positions(decode, batch),
        )

    def _decode_candidates(self, decode: DecodeSignals) -> _DecodeBatch:
        """The decode rows' coda candidates: their output rows and samplers. When the gate
        decides some exit and a candidate samples with a generator, the exits are read
        first and the candidates that do not exit sample greedily (`HELD`: their
        generators must not advance; their tokens are dropped); otherwise the exits and
        hazards ride along with the sampled tokens' copy."""
        read = DecodeRead(decode)
        # Coda batching in time: exits are read, nothing is sampled (the leave comes later).
        candidates = [] if self.rules.defers_leave else decode.candidates.tolist()  # host array
        ids, samplers = decode.rows.request_ids, self.samplers
        pairs = [samplers[ids[row]] for row in candidates]
        if candidates and decode.greedy and all(takes_argmax(pair) for pair in pairs):
            self.transfers.defer(read.packed, read.receive)
            return _DecodeBatch(read, candidates, None, pairs, False, greedy=True)
        if read.gate_decides and not all(is_greedy(pair[0]) for pair in pairs):
            read.receive(self.transfers.to_host(read.packed))  # exits before sampling
            exited = read.exited
            pairs = [pair if exited[row] else HELD for row, pair in zip(candidates, pairs)]
        elif read.packed is not None:
            self.transfers.defer(read.packed, read.receive)
        rows = None
        if candidates and decode.row_logits is None:  # their outputs, for their leave
            rows = decode.out.index_select(0, decode.candidates_on_device[: len(candidates)])
        has_history = any(pair[2] is not None for pair in pairs)
        return _DecodeBatch(read, candidates, rows, pairs, has_history)

    def leave_rows(
        self, leave: LeaveRows, carried: torch.Tensor, positions: torch.Tensor
    ) -> PendingLeave:
        """Held tokens' leave (from their carried states [m, W] at `positions`) and one
        sampling pass on the device; the sampled ids stay there for the step's loop-0 rows
        (`PendingLeave.tokens`), and their read rides along with the step's next copy out."""
        ids = leave.request_ids
        logits = self.coda(
            carried, lambda: decode_spans(leave, range(len(leave))), lambda: positions
        )
        pairs = [self.samplers[rid] for rid in ids]
        batch, failures = self._sample_on_device(logits, pairs)
        has_history = any(pair[2] is not None for pair in pairs)
        pending = PendingLeave(leave, batch, failures, self._record_decode if has_history else None)
        self.transfers.defer(batch.packed, pending.receive)
        return pending

    @staticmethod
    def _sample_on_device(logits: torch.Tensor, samplers: list[tuple]):
        """One sampling pass over logits, not read: (`SampleBatch`, row -> sampling error)."""
        specs, generators, histories = zip(*samplers)
        failures: dict[int, str] = {}
        batch = sample_on_device(logits, list(specs), list(generators), failures, histories)
        return batch, failures

    def _sample_logits(self, logits: torch.Tensor, samplers: list[tuple]):
        """One sampling pass over logits, read: (token ids, row -> `SampledToken` with
        log-probabilities, row -> sampling error)."""
        batch, failures = self._sample_on_device(logits, samplers)
        token_ids, with_logprobs, failed = read_samples(batch, self.transfers.to_host(batch.packed))
        failures.update(failed)
        return token_ids, with_logprobs, failures

    def _record(self, request_id: str, token_id: int) -> None:
        """A request's token became final: its logits-adjustment history counts it."""
        sampler = self.samplers.get(request_id)
        if sampler is not None and sampler[2] is not None:
            sampler[2].record(token_id)

    def _record_decode(self, request_ids, token_ids: np.ndarray) -> None:
        """The decode rows' final tokens (-1: none) into their requests' histories."""
        for row in (token_ids >= 0).nonzero()[0].tolist():  # host array
            self._record(request_ids[row], int(token_ids[row]))

    def _item_results(self, items, states, hazards, last_outputs, exited, sampled):
        results = []
        for i, item in enumerate(items):
            token = sampled.get(i)
            if self.rules.releases_handle(item, exited[i], token is not None):
                self.inflight.done(item.request_id, item.handle)
            else:
                state = InFlight(states[i], hazards[i], last_outputs[i])
                self.inflight.keep(item.request_id, item.handle, state)
            item_hazards = tuple(hazards[i][-item.num_depths :]) if item.needs_gate else ()
            exited_now = bool(exited[i]) or (token is not None and item.kind is not ItemKind.SPEC)
            results.append(
                ItemResult(item.request_id, item.handle, item_hazards, exited_now, None, token)
            )
        return results
