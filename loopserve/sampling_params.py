"""Per-request sampling and looping parameters, validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from loopserve.errors import InvalidRequestError

# The seeds torch.Generator.manual_seed accepts (a signed or unsigned 64-bit integer).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


OUTPUT_KINDS = ("cumulative", "delta", "final_only")
PROMPT_LOGPROBS_LOOPS = ("last", "exit")


MIN_REPETITION_PENALTY = 1e-4  # see `_validate`


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output (needs the `structured` extra, llguidance): exactly
    one of a JSON schema (`json_schema`, a dict or its JSON text; `{"type": "object"}` is any
    JSON object), a regular expression the whole output matches (`regex`), a list of
    strings the output is one of (`choice`), or a Lark grammar in llguidance's dialect
    (`grammar`; the server's enforced tool calls, `loopserve.text.tools.call_grammar`)."""

    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        def bad(why: str) -> InvalidRequestError:
            return InvalidRequestError(f"structured output {why}", param="response_format")

        given = (self.json_schema, self.regex, self.choice, self.grammar)
        if sum(value is not None for value in given) != 1:
            raise bad("needs exactly one of json_schema, regex, choice, grammar")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise bad("grammar must be a string")
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise bad("json_schema must be a JSON object or its text")
        if self.regex is not None and not isinstance(self.regex, str):
            raise bad("regex must be a string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise bad("choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise bad("choice must not be empty")

    @property
    def kind(self) -> str:
        if self.json_schema is not None:
            return "JSON schema"
        if self.grammar is not None:
            return "grammar"
        return "regex" if self.regex is not None else "choice"


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how deep to loop.

    `temperature == 0` is greedy. `top_k <= 0` (or -1) disables top-k. `seed` makes sampling
    reproducible independently of batch composition. `logprobs=k` returns the chosen token's
    logprob plus the top-k alternatives. Looping: every output token runs between `min_loops`
    and `max_loops` loops (None = the model's depth); `exit_threshold` is the gate CDF at which
    a token may exit early (1.0 never exits early).

    Logits adjustments (vLLM's semantics, applied in this order before temperature, top-k and
    top-p, greedy decoding included): `logit_bias` adds a bias to token ids; `min_tokens`
    forbids the stop tokens (`stop_token_ids` and EOS) until that many tokens were generated;
    `repetition_penalty` divides the positive logits (multiplies the negative ones) of tokens
    seen in the prompt or the output; `frequency_penalty` subtracts the penalty times each
    token's count in the output, `presence_penalty` once per token present in it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Log-probability of every prompt token after the first (from the last loop at full
    # depth), with this many alternatives each; None: not computed.
    prompt_logprobs: int | None = None
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float = 1.0
    priority: int = 0
    exit_trace: tuple[int, ...] | None = field(default=None)
    # What each output carries: "cumulative" (everything so far plus the step's delta),
    # "delta" (only what is new; the server's streams) or "final_only" (one output at the end).
    output_kind: str = "cumulative"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, sorted by token id; a dict {token id: bias} is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # Which loop's output scores a prompt position (with `prompt_logprobs`): "last", the
    # last loop at full depth (what the Hugging Face Ouro forward returns), or "exit", the
    # loop this request's exit rule picks for that position (the CDF threshold over the
    # exit gate, within min/max loops; what `loopserve eval` measures).
    prompt_logprobs_loop: str = "last"
    # The argmax-stability criterion's stable steps for this request (a model whose exit
    # signal is that criterion: the token exits once its argmax held this many steps); None:
    # the engine's (the authors' 2 unless `--exit-criterion-threshold` sets another).
    exit_stable_steps: int | None = None
    # Overload brownout (an engine with `brownout_waiting_high` > 0): while the engine is
    # overloaded this request's decode tokens may run fewer loops than `max_loops`, never
    # fewer than this (None: its budget is never lowered). `loopserve.scheduler.brownout`.
    brownout_floor: int | None = None
    # Constrain the output to a JSON schema, a regex or a list of choices (`StructuredOutput`).
    structured_output: StructuredOutput | None = None
    # Self-speculative decoding for this request when the engine runs it
    # (`speculative_tokens` > 0); False decodes it plainly in the same engine.
    speculative: bool = True

    def __post_init__(self) -> None:
        # Normalise list inputs to tuples so the object stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.exit_trace is not None:
            object.__setattr__(self, "exit_trace", tuple(self.exit_trace))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = tuple(sorted((token, value) for token, value in (bias or ())))
        except (TypeError, ValueError):  # not pairs, or keys that do not order
            raise InvalidRequestError(
                f"logit_bias must map token ids to biases, got {self.logit_bias!r}",
                param="logit_bias",
            ) from None
        object.__setattr__(self, "logit_bias", pairs)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            value = getattr(self, param)
            return InvalidRequestError(f"{param} {why}, got {value!r}", param=param)

        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be -1/0 (disabled) or an integer >= 1")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20
        ):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs_loop not in PROMPT_LOGPROBS_LOOPS:
            raise bad("prompt_logprobs_loop", f"must be one of {', '.join(PROMPT_LOGPROBS_LOOPS)}")
        if not _is_int(self.min_loops) or self.min_loops < 1:
            raise bad("min_loops", "must be an integer >= 1")
        if self.max_loops is not None:
            if not _is_int(self.max_loops) or self.max_loops < 1:
                raise bad("max_loops", "must be an integer >= 1")
            if self.max_loops < self.min_loops:
                raise bad("max_loops", f"must be >= min_loops ({self.min_loops})")
        if not _is_number(self.exit_threshold) or not 0.0 <= self.exit_threshold <= 1.0:
            raise bad("exit_threshold", "must be in [0, 1]")
        if not _is_int(self.priority):
            raise bad("priority", "must be an integer")
        if self.exit_stable_steps is not None and (
            not _is_int(self.exit_stable_steps) or not 1 <= self.exit_stable_steps <= 1024
        ):
            raise bad("exit_stable_steps", "must be an integer in [1, 1024]")
        if self.brownout_floor is not None and (
            not _is_int(self.brownout_floor) or self.brownout_floor < 1
        ):
            raise bad("brownout_floor", "must be an integer >= 1")
        if self.exit_trace is not None and not all(_is_int(x) and x >= 1 for x in self.exit_trace):
            raise bad("exit_trace", "must be loop counts >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        # A floor above zero: logits are divided by it in float32, where a value as small as
        # 1e-300 is 0 and the division makes infinities (the request then failed with a 500).
        if (
            not _is_number(self.repetition_penalty)
            or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0
        ):
            raise bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, 100]")
        if not all(
            _is_int(token) and token >= 0 and _is_number(value) and -100.0 <= value <= 100.0
            for token, value in self.logit_bias
        ):
            raise bad("logit_bias", "must map token ids >= 0 to biases in [-100, 100]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens ({self.max_tokens})]")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "must be true or false")
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise bad("structured_output", "must be a StructuredOutput")

    def resolve_loops(self, num_loops: int) -> SamplingParams:
        """Bind `max_loops` to the model depth and check both bounds against it."""
        max_loops = num_loops if self.max_loops is None else self.max_loops
        if max_loops > num_loops:
            raise InvalidRequestError(
                f"max_loops must be <= the model's loop count ({num_loops}), got {max_loops}",
                param="max_loops",
            )
        if self.min_loops > max_loops:
            raise InvalidRequestError(
                f"min_loops ({self.min_loops}) must be <= max_loops ({max_loops})",
                param="min_loops",
            )
        return replace(self, max_loops=max_loops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
