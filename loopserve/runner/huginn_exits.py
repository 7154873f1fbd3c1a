"""The exits of the Huginn executor (`runner/huginn_runner.py`), as collaborators with
explicit inputs: `DecodeExits` checks the criterion of every decode row the scheduler lets
exit (GATE), decides exits with the `criterion` rule (`exit.columns.decide_criterion_exits`),
reports the criterion's scores as the rows' signals, finalizes and samples; `PromptExits` runs the
authors' prompt rule (`prompt_exits`: a whole prompt exits as one token)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from loopserve.contracts import DecodeResults, SampledToken
from loopserve.exit.columns import GATE, decide_criterion_exits
from loopserve.exit.criteria import ExitCriterion
from loopserve.runner.huginn_parts import DecodeToken


class DecodeExits:
    """Inputs: a fresh criterion, the decode tokens in flight (request -> `DecodeToken`, kept
    and updated here), the coda of some decode rows, the finalize copies, the sampler, the
    per-position steps record (`ran`), the model's r and device."""

    def __init__(
        self,
        *,
        criterion: Callable[[], ExitCriterion],
        decoding: dict,
        decode_coda: Callable,
        finalize: Callable,
        sample: Callable,
        ran: Callable,
        num_loops: int,
        device: torch.device,
    ) -> None:
        self.criterion, self.decoding, self.decode_coda = criterion, decoding, decode_coda
        self.finalize, self.sample, self.ran = finalize, sample, ran
        self.num_loops, self.device = num_loops, device

    def __call__(self, decode, out, tables, failed):
        """Criteria, exits, finalize copies and samples of a call's decode rows: (results,
        early exits, finalized tokens)."""
        state_in, state_out, e, pos = out
        n = len(decode)
        depths = decode.depths
        # The criterion's score where it was checked (the rows the plan lets it decide,
        # GATE: under `criterion` no other row reads a signal), and whether it fired there.
        scores = np.full(n, np.nan)
        fired = np.zeros(n, bool)
        gate = np.flatnonzero(decode.exit_code == GATE)
        rule = self.criterion()
        fields = rule.state_fields
        # Tokens that start here: their criterion state from their initial state.
        starting = np.flatnonzero(depths == 0)
        start_state = {}
        if len(starting):
            rule.init(state_in[starting].unsqueeze(1))
            for j, row in enumerate(starting.tolist()):
                start_state[row] = [getattr(rule, f)[j] for f in fields]
        criterion_state = {
            row: start_state[row] if row in start_state else self.decoding[rid].criterion
            for row, rid in enumerate(decode.request_ids)
        }
        logits = None
        logit_rows: list[int] = []
        if len(gate):
            rows = gate.tolist()
            if rule.needs_logits:
                logit_rows = rows
                logits = self.decode_coda(decode, rows, state_out, tables)
            for f, name in enumerate(fields):
                setattr(rule, name, torch.stack([criterion_state[r][f] for r in rows]))
            if rule.name != "argmax-stability":  # the request's (argmax: the engine's steps)
                rule.threshold = torch.from_numpy(decode.threshold[gate]).to(self.device)
            fire, values = rule.check(state_out[gate].unsqueeze(1), logits)
            read = torch.stack([fire.double(), values.double()]).cpu().numpy()  # one read
            fired[gate] = read[0] != 0.0
            scores[gate] = read[1]
            for j, r in enumerate(rows):
                criterion_state[r] = [getattr(rule, name)[j] for name in fields]
        exited = decide_criterion_exits(decode.exit_code, fired)
        # Keep the tokens that go on; finalize and sample the ones that exit.
        for row, rid in enumerate(decode.request_ids):
            if exited[row]:
                self.decoding.pop(rid, None)
            else:
                self.decoding[rid] = DecodeToken(state_out[row], e[row], criterion_state[row])
        exit_rows = np.flatnonzero(exited).tolist()
        for r in exit_rows:
            self.ran(decode.request_ids[r], [int(decode.positions[r])], int(depths[r]) + 1)
        finalized = 0
        if exit_rows:
            finalized = self.finalize(
                [(tables[decode.request_ids[r]], int(decode.positions[r]), int(depths[r]))
                 for r in exit_rows]
            )  # fmt: skip
        token_ids = np.full(n, -1, np.int64)
        logprobs: dict[int, SampledToken] = {}
        if exit_rows:
            # The checks' logits where they ran this loop; the coda for the other exits.
            row_logits = dict(zip(logit_rows, logits)) if logits is not None else {}
            missing = [r for r in exit_rows if r not in row_logits]
            if missing:
                row_logits.update(
                    zip(missing, self.decode_coda(decode, missing, state_out, tables))
                )
            picked = [row_logits[r] for r in exit_rows]
            requests = [decode.request_ids[r] for r in exit_rows]
            sampled = self.sample(torch.stack(picked), requests, failed)
            for r, token in zip(exit_rows, sampled, strict=True):
                if token is None:
                    continue
                token_ids[r] = token.token_id
                if token.logprob is not None:
                    logprobs[r] = token
        early = int(np.count_nonzero(exited & (depths + 1 < self.num_loops)))
        return DecodeResults(exited, scores, token_ids, logprobs), early, finalized


class PromptExits:
    """Inputs: a fresh criterion, the requests' r (`max_loops`), the coda, the finalize
    copies and the steps record. Per step: `begin`, `start` a prompt's
    criterion from its initial state, `check` after each call; `exited` maps an item to its
    (loops used, logits)."""

    def __init__(
        self,
        *,
        criterion: Callable[[], ExitCriterion],
        max_loops: dict,
        coda: Callable,
        finalize: Callable,
        ran: Callable,
    ) -> None:
        self.criterion, self.max_loops = criterion, max_loops
        self.coda, self.finalize, self.ran = coda, finalize, ran
        self.rules: dict[int, ExitCriterion] = {}
        self.exited: dict[int, tuple[int, torch.Tensor]] = {}

    def begin(self) -> None:
        self.rules, self.exited = {}, {}

    def start(self, index: int, initial: torch.Tensor) -> None:
        rule = self.criterion()
        rule.init(initial.unsqueeze(0))
        self.rules[index] = rule

    def check(self, k, items, active, tables, states) -> int:
        """After call k: the criterion of each whole prompt that may exit; a prompt that exits
        gets its finalize copies and its coda now. Returns the finalize copies made."""
        copies = 0
        for i in active:
            rule = self.rules.get(i)
            if rule is None:
                continue
            item, request_id = items[i], items[i].request_id
            loop = item.depth + k  # 0-based
            state = states[i][0]
            assert item.exit_rule is not None and item.token_start == 0
            r = self.max_loops[request_id]
            positions = list(range(item.token_start, item.token_start + item.token_count))
            spans = [(tables[request_id], 0, item.token_count)]
            exits, logits = loop == r - 1, None
            checks = item.exit_rule.threshold < 1.0 and loop + 1 >= item.exit_rule.min_loops
            if checks and loop < r - 1:
                if rule.needs_logits:
                    logits = self.coda(state, spans, positions)
                if rule.name != "argmax-stability":
                    rule.threshold = item.exit_rule.threshold
                fired, _ = rule.check(state.unsqueeze(0), None if logits is None else logits[-1:])
                exits = bool(fired[0])
            if not exits:
                continue
            if logits is None:
                logits = self.coda(state, spans, positions)
            self.exited[i] = (loop + 1, logits)
            self.ran(request_id, positions, loop + 1)
            del self.rules[i]
            table = tables[request_id]
            copies += self.finalize([(table, p, loop) for p in positions])
        return copies
