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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from loopserve.contracts import (
    DecodeResults,
    ItemResult,
    RequestFailure,
    SampledToken,
    SampleSpec,
    StepRules,
)
from loopserve.exit import ExitMode, choose_exit_from_hazards
from loopserve.exit.columns import EXIT
from loopserve.runner.decode_rows import DecodeSignals
from loopserve.runner.handles import HandleTable
from loopserve.runner.sampler import is_greedy, read_samples, sample_on_device
from loopserve.runner.swap import InFlight
from loopserve.runner.transfers import Transfers

HELD = (SampleSpec(temperature=0.0), None)  # a candidate that does not exit: no generator


class DecodeSampled(NamedTuple):
    """Tokens sampled for decode rows: their rows, ids, and log-probabilities where asked."""

    rows: list[int]
    token_ids: list[int]
    logprobs: dict[int, SampledToken]


class CodaOutput(NamedTuple):
    results: list[ItemResult]
    failed: tuple[RequestFailure, ...]  # requests whose sampling raised
    decode: DecodeResults | None


class _DecodeRead:
    """The decode rows' exit flags and hazards, filled when the device is read."""

    def __init__(self, signals: DecodeSignals) -> None:
        rows = signals.rows
        self.num_rows = len(rows)
        self.exited = rows.exit_code == EXIT  # final unless the gate decides
        self.hazards = np.full(self.num_rows, np.nan)
        parts = []
        if signals.exits is not None:
            parts.append(signals.exits.double())
        if signals.hazards is not None:
            parts.append(signals.hazards.double())
        self.packed = torch.cat(parts) if parts else None
        self.gate_decides = signals.exits is not None
        self.needs_gate = rows.needs_gate

    def receive(self, values: list[float]) -> None:
        read = np.array(values)
        n = self.num_rows
        if self.gate_decides:
            self.exited = read[:n] != 0.0
            read = read[n:]
        if len(read):
            self.hazards[self.needs_gate] = read[self.needs_gate]


class Coda:
    """Explicit inputs: the step rules, the exit mode, the (timed) coda function, the
    per-request samplers, the transfer counter and the in-flight handle table."""

    def __init__(
        self,
        *,
        rules: StepRules,
        exit_mode: ExitMode,
        coda: Callable[[torch.Tensor], torch.Tensor],
        samplers: dict,
        transfers: Transfers,
        inflight: HandleTable[InFlight],
    ) -> None:
        self.rules = rules
        self.exit_mode = exit_mode
        self.coda = coda
        self.samplers = samplers
        self.transfers = transfers
        self.inflight = inflight

    def __call__(
        self,
        items,
        states,
        hazards,
        last_outputs,
        exited,
        decode: DecodeSignals | None = None,
    ) -> CodaOutput:
        """Coda and sampling of the exiting rows; the items' results, the requests whose
        sampling raised (each fails alone) and the decode rows' results."""
        scores = self._score_prompts(items, states) if items else {}
        read = None
        coda_rows: list[torch.Tensor] = []
        owners: list[tuple[bool, int]] = []  # (a decode row?, its index)
        held: set[int] = set()  # decode candidates known not to exit: sampled greedily
        if decode is not None:
            read = _DecodeRead(decode)
            candidates = decode.candidates
            if read.gate_decides and not self._all_greedy(decode.rows.request_ids, candidates):
                read.receive(self.transfers.to_host(read.packed))  # exits before sampling
                held = set(candidates[~read.exited[candidates]].tolist())  # host array
            elif read.packed is not None:
                self.transfers.defer(read.packed, read.receive)
            if len(candidates):
                index = decode.candidates_on_device[: len(candidates)]
                coda_rows.append(decode.out.index_select(0, index))
                owners += [(True, row) for row in candidates.tolist()]  # host array
        first_tokens = [self.rules.samples_first_token(item) for item in items]
        if any(first_tokens):
            self.transfers.flush()  # the first token's exit is chosen from its hazards
        loops_used: dict[int, int] = {}
        for i, item in enumerate(items):
            if first_tokens[i]:
                assert item.exit_rule is not None
                loops = choose_exit_from_hazards(
                    self.exit_mode, item.exit_rule, hazards[i] or None, item.trace_loops
                )
                coda_rows.append(last_outputs[i][loops - 1])
                owners.append((False, i))
                loops_used[i] = loops
        sampled, decode_sampled, failed = self._sample(items, decode, coda_rows, owners, held)
        self.transfers.flush()  # hazards and exits not read yet (no coda this step)
        results = []
        if items:
            results = self._item_results(items, states, hazards, last_outputs, exited, sampled)
            for i, result in enumerate(results):
                if i in scores or i in loops_used:
                    results[i] = result._replace(
                        loops_used=loops_used.get(i), prompt_logprobs=scores.get(i, ())
                    )
        decode_results = None
        if read is not None:
            decode_results = self._decode_results(read, decode_sampled)
        return CodaOutput(results, tuple(failed), decode_results)

    def _all_greedy(self, request_ids, rows: np.ndarray) -> bool:
        samplers = self.samplers
        rows_list = rows.tolist()  # host array
        return all(is_greedy(samplers[request_ids[row]][0]) for row in rows_list)

    def _sample(self, items, decode, coda_rows, owners, held):
        """One coda call and one sampling pass over every coda row; (item -> token, decode row
        -> token, failures). Decode rows in `held` do not exit: they are sampled greedily,
        so their generators do not advance, and their tokens are dropped."""
        sampled: dict[int, SampledToken] = {}
        decode_sampled = DecodeSampled([], [], {})
        failed: list[RequestFailure] = []
        if not coda_rows:
            return sampled, decode_sampled, failed
        decode_ids = decode.rows.request_ids if decode is not None else ()
        request_ids = [
            decode_ids[index] if is_decode else items[index].request_id
            for is_decode, index in owners
        ]
        logits = self.coda(torch.cat(coda_rows) if len(coda_rows) > 1 else coda_rows[0])
        samplers = self.samplers
        specs, generators = zip(
            *(
                HELD if is_decode and index in held else samplers[request_id]
                for (is_decode, index), request_id in zip(owners, request_ids)
            )
        )
        failures: dict[int, str] = {}
        batch = sample_on_device(logits, list(specs), list(generators), failures)
        token_ids, with_logprobs = read_samples(batch, self.transfers.to_host(batch.packed))
        for row, ((is_decode, index), token_id) in enumerate(zip(owners, token_ids)):
            if row in failures:  # this request fails alone; the call's other rows go on
                failed.append(RequestFailure(request_ids[row], f"sampling failed: {failures[row]}"))
            elif is_decode:
                decode_sampled.rows.append(index)
                decode_sampled.token_ids.append(token_id)
                if row in with_logprobs:
                    decode_sampled.logprobs[index] = with_logprobs[row]
            else:
                sampled[index] = with_logprobs.get(row) or SampledToken(token_id)
        return sampled, decode_sampled, failed

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
            exited_now = bool(exited[i]) or token is not None
            results.append(
                ItemResult(item.request_id, item.handle, item_hazards, exited_now, None, token)
            )
        return results

    @staticmethod
    def _decode_results(read: _DecodeRead, sampled: DecodeSampled) -> DecodeResults:
        token_ids = np.full(read.num_rows, -1, np.int64)
        token_ids[sampled.rows] = sampled.token_ids
        token_ids[~read.exited] = -1  # a greedy candidate that did not exit drops its token
        logprobs = {row: token for row, token in sampled.logprobs.items() if read.exited[row]}
        return DecodeResults(read.exited, read.hazards, token_ids, logprobs)

    def _score_prompts(self, items, states) -> dict[int, tuple[SampledToken, ...]]:
        """Prompt logprobs of the items with `score_ids`, from their rows' last-loop output:
        one coda call over all of them and one copy to the host."""
        scored = [i for i, item in enumerate(items) if item.score_ids]
        if not scored:
            return {}
        rows = torch.cat([states[i][: len(items[i].score_ids)] for i in scored])
        logprobs = torch.log_softmax(self.coda(rows).float(), dim=-1)
        ids = [t for i in scored for t in items[i].score_ids]
        index = self.transfers.to_device(ids)
        columns = [logprobs.gather(1, index[:, None]).double()]
        top = max(items[i].score_top for i in scored)
        if top:
            values, indices = logprobs.topk(top, dim=-1)
            columns += [values.double(), indices.double()]
        width = 1 + 2 * top  # per row: the chosen logprob, top values, top ids
        flat = self.transfers.to_host(torch.cat(columns, dim=1).reshape(-1))
        scores: dict[int, tuple[SampledToken, ...]] = {}
        at = 0
        for i in scored:
            k = items[i].score_top
            entries = []
            for token_id in items[i].score_ids:
                row = flat[at : at + width]
                alternatives = tuple((int(row[1 + top + j]), row[1 + j]) for j in range(k))
                entries.append(SampledToken(token_id, row[0], alternatives))
                at += width
            scores[i] = tuple(entries)
        return scores
