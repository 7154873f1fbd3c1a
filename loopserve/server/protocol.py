"""OpenAI-compatible request and response models (pydantic v2) for the HTTP server.

Requests are strict and closed (`extra="forbid"`, no string-to-number coercion): an unknown or
unsupported field is a 400 that names it, never silently ignored. The sampling controls
`presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI's: token id strings to biases)
and vLLM's `repetition_penalty` and `min_tokens` have vLLM's semantics (`SamplingParams`);
`stream_options.continuous_usage_stats` (vLLM's, sent by guidellm and `vllm bench serve`)
puts the usage so far in every streamed chunk. Looped-model extensions (`min_loops`,
`max_loops`, `exit_threshold`) and vLLM-style extras (`top_k`, `ignore_eos`,
`stop_token_ids`, `return_token_ids`) are ordinary optional fields. Structured output:
OpenAI's `response_format` (`json_object`, `json_schema`) or vLLM's `guided_json`,
`guided_regex`, `guided_choice`. Numeric ranges are checked once, by `SamplingParams`, not
here. Responses add `exit_depths` (loops used per output token)
to every choice. This module has what the endpoints share and the completions models;
`protocol_chat` the chat completions models, `protocol_tools` the tool-calling parts and
`protocol_responses` the Responses API's.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from loopserve.errors import InvalidRequestError
from loopserve.sampling_params import StructuredOutput
from loopserve.text.structured import close_objects as closed_schema

MAX_N = 64


_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a `logit_bias` key


def _json_value(value: Any) -> Any:
    """A schema given as JSON text, parsed (text that is not JSON stays as it is: its
    check reports it)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's extension, sent by default by guidellm: usage (tokens so far) in every chunk.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`."""

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (JSON that follows `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with, and only with, type "json_schema"')
        return self


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    # A named loop budget (`--loop-classes`): its loop fields fill the ones left unset.
    loop_class: str | None = None
    # Overload brownout: the fewest loops this request's tokens may be lowered to.
    brownout_floor: int | None = None
    # Looped-model extensions.
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_stable_steps: int | None = None  # argmax-stability's steps (SamplingParams)
    # Self-speculative decoding for this request when the server runs it (None: on).
    speculative: bool | None = None
    # Return output token ids per choice (vLLM's extension of the same name).
    return_token_ids: bool = False
    # Sampling controls (ranges checked by `SamplingParams`).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string) -> bias
    min_tokens: int | None = None  # vLLM's
    # vLLM's: per prompt token, the log-probabilities of it and of the k most likely tokens.
    prompt_logprobs: int | None = None
    # Looped-model extension: which loop scores a prompt position ("last" or "exit").
    prompt_logprobs_loop: str | None = None
    # Structured output: OpenAI's `response_format`, or vLLM's `guided_json`,
    # `guided_regex`, `guided_choice` (one of them).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def structured_output(self, close_objects: bool = False) -> StructuredOutput | None:
        """The output constraint the request asks for (None: none); more than one is a 400
        (`InvalidRequestError` from `StructuredOutput`). A `json_schema` with `strict` (which
        OpenAI requires to be closed), or any schema when `close_objects` (the server's
        `--json-schema-closed`), has its objects that say nothing of other keys closed."""
        kinds: dict[str, object] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            kinds["json_schema"] = {"type": "object"}
        elif fmt is not None and fmt.json_schema is not None:
            schema = fmt.json_schema.schema_ or {"type": "object"}
            close = close_objects or bool(fmt.json_schema.strict)
            kinds["json_schema"] = closed_schema(schema) if close else schema
        for name, value in (
            ("json_schema", self.guided_json),
            ("regex", self.guided_regex),
            ("choice", self.guided_choice),
        ):
            if value is not None:
                if name == "json_schema" and close_objects:
                    value = closed_schema(_json_value(value))
                if name in kinds:
                    raise InvalidRequestError(
                        "give one of response_format, guided_json, guided_regex, guided_choice",
                        param="response_format",
                    )
                kinds[name] = value
        if not kinds:
            return None
        if len(kinds) > 1:
            raise InvalidRequestError(
                "give one of response_format, guided_json, guided_regex, guided_choice",
                param="response_format",
            )
        return StructuredOutput(**kinds)  # type: ignore[arg-type]

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            # ASCII digits only (str.isdigit takes "²" and "١٢"), and few enough that int()
            # stays cheap and the id fits the vocabulary's integer type.
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(
                    f"keys must be token ids (strings of at most 10 ASCII digits), got {key[:40]!r}"
                )
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


def _without_unset(data: dict, keys: tuple[str, ...]) -> dict:
    """`data` without those of `keys` whose value is None (fields a response shows only when
    they apply: no `"key": null`, which some clients reject)."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens of the reasoning (`--reasoning-parser`)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    # Looped-model extension: loops over all output tokens (the sum of their exit depths)
    # and per output token: what the request cost in core loops.
    completion_loops: int | None = None
    mean_loops: float | None = None

    @model_serializer(mode="wrap")
    def _details_only_when_set(self, handler):
        return _without_unset(
            handler(self), ("completion_tokens_details", "completion_loops", "mean_loops")
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one token's log-probability at one prompt position."""

    logprob: float
    rank: int | None = None  # 1 + the number of more likely tokens
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id: logprob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    exit_depths: list[int] = Field(default_factory=list)
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # With a scored prompt: per prompt token, the loop whose output scored it (None first).
    prompt_exit_depths: list[int | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    loop_class: str | None = None  # the request's loop class (`--loop-classes`)

    @model_serializer(mode="wrap")
    def _class_only_when_set(self, handler):
        return _without_unset(handler(self), ("loop_class",))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loopserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo
