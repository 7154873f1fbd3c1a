"""Text out: per-request incremental detokenization, stop strings and `RequestOutput` assembly.

The engine core works in token ids; after each step the engine hands this room one
`RequestDelta` per request that produced something (outputs.py): only what is new. For each
request it keeps an `IncrementalDetokenizer`, the text released but not yet reported and, for
callers that want whole outputs (`output_kind` "cumulative" or "final_only"), the accumulated
tokens, exit depths and logprobs. A "delta" request keeps nothing that grows with its output
(its token times are the request's own list, copied once, into its final output's metrics),
so the work per step is the same at token 10 and at token 10,000.

Finish reasons are decided once, by the engine (`LLMEngine._delta`): a stop-string hit here
(`detokenize`) makes the engine finish the request and report "stop" with `stop_reason` the
string, also when the same token reached max_tokens; otherwise the scheduler's reason, with
`stop_reason` the stop token when one ended it.
"""

from __future__ import annotations

from collections.abc import Sequence

from loopserve.outputs import RequestDelta, RequestMetrics, RequestOutput, TokenLogprob
from loopserve.text.detokenizer import IncrementalDetokenizer
from loopserve.text.tokenizer import Tokenizer


class _RequestText:
    """One request's text state and, unless its outputs are deltas, what it produced so far."""

    __slots__ = (
        "prompt",
        "kind",
        "detokenizer",
        "pending_text",
        "stop_hit",
        "text",
        "token_ids",
        "exit_depths",
        "logprobs",
        "prompt_logprobs",
    )

    def __init__(
        self, prompt: str | None, kind: str, detokenizer: IncrementalDetokenizer | None
    ) -> None:
        self.prompt = prompt
        self.kind = kind
        self.detokenizer = detokenizer
        self.pending_text = ""  # released text not yet in an output's `new_text`
        self.stop_hit: str | None = None
        self.text = ""  # released text (not kept for "delta")
        self.token_ids: list[int] = []  # not kept for "delta"
        self.exit_depths: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def release(self, text: str) -> None:
        self.pending_text += text
        if self.kind != "delta":
            self.text += text

    def accumulate(self, delta: RequestDelta) -> None:
        if delta.new_prompt_logprobs is not None and self.kind != "delta":
            self.prompt_logprobs = [None, *delta.new_prompt_logprobs]
        if self.kind != "delta":
            self.token_ids.extend(delta.new_token_ids)
            self.exit_depths.extend(delta.new_exit_depths)
            if delta.new_logprobs is not None:
                self.logprobs.extend(delta.new_logprobs)


class OutputProcessor:
    """Detokenizes and assembles outputs for the requests of one engine; see the module doc."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestText] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str],
        prompt_text: str | None,
        output_kind: str = "cumulative",
    ) -> None:
        """Start tracking a request whose prompt was given as `prompt_text` (None for ids)."""
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, list(prompt_token_ids), stop=tuple(stop)
            )
        self._states[request_id] = _RequestText(prompt_text, output_kind, detokenizer)

    def forget(self, request_id: str) -> None:
        """Stop tracking a request that left this engine without a final output (hand-off)."""
        self._states.pop(request_id, None)

    def mark_reported(self, delta: RequestDelta) -> None:
        """Take the request's outputs so far (an imported request: its exporter streamed them)
        as already reported; their text still feeds the detokenizer."""
        self.detokenize(delta.request_id, delta.new_token_ids)
        state = self._states[delta.request_id]
        state.accumulate(delta)
        state.pending_text = ""

    def detokenize(self, request_id: str, new_token_ids: Sequence[int]) -> str | None:
        """Read a step's new tokens; return the stop string they completed (first time only),
        or None. The caller decides what a hit finishes."""
        state = self._states[request_id]
        if state.detokenizer is None or state.stop_hit is not None:
            return None
        for token_id in new_token_ids:
            update = state.detokenizer.add_token(token_id)
            state.release(update.new_text)
            if update.stop_hit is not None:
                state.stop_hit = update.stop_hit
                return update.stop_hit
        return None

    def make_output(self, delta: RequestDelta, *, error: str | None = None) -> RequestOutput | None:
        """The request's `RequestOutput` for this step in its output kind (None: a
        "final_only" request that has not finished). A finished request's held-back text is
        flushed and it is forgotten."""
        state = self._states[delta.request_id]
        state.accumulate(delta)
        final = delta.finish_reason is not None
        if final:
            if state.detokenizer is not None and state.stop_hit is None:
                state.release(state.detokenizer.finish())
            del self._states[delta.request_id]
        elif state.kind == "final_only":
            return None
        new_text, state.pending_text = state.pending_text, ""
        stop_reason: str | int | None = state.stop_hit
        if stop_reason is None and delta.finish_reason == "stop":
            stop_reason = delta.stop_token_id
        metrics = RequestMetrics(
            delta.arrival_s,
            delta.first_scheduled_s,
            delta.first_token_s,
            delta.finished_s,
            tuple(delta.token_times_s) if final or state.kind == "cumulative" else (),
            delta.num_cached_prompt_tokens,
            delta.num_preemptions,
            *delta.spec,
        )
        if state.kind == "delta":
            token_ids, text, exit_depths = delta.new_token_ids, new_text, delta.new_exit_depths
            logprobs = delta.new_logprobs
            prompt_logprobs = delta.new_prompt_logprobs
            if prompt_logprobs is not None:
                prompt_logprobs = [None, *prompt_logprobs]
        else:
            token_ids, exit_depths = state.token_ids, state.exit_depths
            logprobs = state.logprobs if delta.new_logprobs is not None else None
            prompt_logprobs = state.prompt_logprobs
            text = state.text
            if not final:  # the state keeps growing: hand out copies
                token_ids, exit_depths = list(token_ids), list(exit_depths)
                logprobs = None if logprobs is None else list(logprobs)
        # Positional, in field order (built once per request per step): request_id, prompt,
        # prompt_token_ids, token_ids, text, exit_depths, finish_reason, metrics, logprobs,
        # new_token_ids, new_text, new_exit_depths, stop_reason, error, num_output_tokens,
        # output_kind, prompt_logprobs.
        return RequestOutput(
            delta.request_id,
            state.prompt,
            delta.prompt_token_ids,
            token_ids,
            text,
            exit_depths,
            delta.finish_reason,
            metrics,
            logprobs,
            delta.new_token_ids,
            new_text,
            delta.new_exit_depths,
            stop_reason,
            error,
            delta.num_output_tokens,
            state.kind,
            prompt_logprobs,
        )


__all__ = ["OutputProcessor"]
