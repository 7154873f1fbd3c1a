"""Text out: per-request incremental detokenization, stop strings and `RequestOutput` assembly.

The engine core works in token ids; this room turns a request's token-level state (the
scheduler's `Request`) into what callers read. For each request it keeps an
`IncrementalDetokenizer` and what has been reported so far, so every `RequestOutput` carries the
cumulative fields plus the delta since the previous output of that request.

Finish reasons: the output processor never sets one. `detokenize` reports a stop-string hit;
the engine then finishes the request (reason STOP) through the scheduler, the owner of
`Request.finish_reason`, and `make_output` copies the reason from the request. When the token
that completed a stop string had already finished the request (max_tokens reached), the
scheduler turns "length" into "stop" (as the OpenAI API reports it); the text is cut at the
stop string and `stop_reason` names it.
"""

from __future__ import annotations

from loopserve.outputs import RequestMetrics, RequestOutput, TokenLogprob
from loopserve.scheduler.request import FinishReason, Request
from loopserve.text.detokenizer import IncrementalDetokenizer
from loopserve.text.tokenizer import Tokenizer


class _RequestText:
    """One request's text state: its detokenizer and what its outputs reported so far."""

    __slots__ = (
        "prompt",
        "detokenizer",
        "text",
        "pending_text",
        "num_detokenized",
        "num_reported",
        "stop_hit",
    )

    def __init__(self, prompt: str | None, detokenizer: IncrementalDetokenizer | None) -> None:
        self.prompt = prompt
        self.detokenizer = detokenizer
        self.text = ""
        self.pending_text = ""  # released text not yet in an output's `new_text`
        self.num_detokenized = 0  # output tokens fed to the detokenizer
        self.num_reported = 0  # output tokens already in an output's `new_token_ids`
        self.stop_hit: str | None = None


class OutputProcessor:
    """Detokenizes and assembles outputs for the requests of one engine; see the module doc."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestText] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add_request(self, request: Request, prompt_text: str | None) -> None:
        """Start tracking `request`, whose prompt was given as `prompt_text` (None for ids)."""
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, stop=request.params.stop
            )
        self._states[request.request_id] = _RequestText(prompt_text, detokenizer)

    def forget(self, request_id: str) -> None:
        """Stop tracking a request that left this engine without a final output (hand-off)."""
        self._states.pop(request_id, None)

    def mark_reported(self, request: Request) -> None:
        """Count the request's output tokens so far as already reported (an imported request:
        its exporter streamed them); their text still feeds the detokenizer."""
        self.detokenize(request)
        state = self._states[request.request_id]
        state.num_reported = len(request.output_token_ids)
        state.pending_text = ""

    def detokenize(self, request: Request) -> str | None:
        """Read the request's output tokens not read yet; return the stop string they
        completed (first time only), or None. The caller decides what a hit finishes."""
        state = self._states[request.request_id]
        new_ids = request.output_token_ids[state.num_detokenized :]
        state.num_detokenized = len(request.output_token_ids)
        if state.detokenizer is None or state.stop_hit is not None:
            return None
        for token_id in new_ids:
            update = state.detokenizer.add_token(token_id)
            state.text += update.new_text
            state.pending_text += update.new_text
            if update.stop_hit is not None:
                state.stop_hit = update.stop_hit
                return update.stop_hit
        return None

    def make_output(self, request: Request, *, error: str | None = None) -> RequestOutput:
        """The request's `RequestOutput` now: cumulative fields plus everything new since its
        previous output. A finished request's held-back text is flushed and it is forgotten."""
        state = self._states[request.request_id]
        final = request.is_finished
        if final:
            if state.detokenizer is not None and state.stop_hit is None:
                tail = state.detokenizer.finish()
                state.text += tail
                state.pending_text += tail
            del self._states[request.request_id]
        new_ids = request.output_token_ids[state.num_reported :]
        state.num_reported = len(request.output_token_ids)
        new_text, state.pending_text = state.pending_text, ""
        stop_reason: str | int | None = state.stop_hit
        if stop_reason is None and request.finish_reason is FinishReason.STOP:
            stop_reason = request.output_token_ids[-1] if request.output_token_ids else None
        times = request.times
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = [
                TokenLogprob(s.token_id, s.logprob or 0.0, s.top_logprobs) for s in request.logprobs
            ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=state.text,
            exit_depths=list(request.exit_depths),
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            metrics=RequestMetrics(
                times.arrival_s,
                times.first_scheduled_s,
                times.first_token_s,
                times.finished_s,
                tuple(times.token_times_s),
                num_cached_prompt_tokens=request.num_cached_prompt_tokens,
                num_preemptions=request.num_preemptions,
            ),
            logprobs=logprobs,
            new_token_ids=list(new_ids),
            new_text=new_text,
            new_exit_depths=request.exit_depths[-len(new_ids) :] if new_ids else [],
            stop_reason=stop_reason,
            error=error,
        )


__all__ = ["OutputProcessor"]
