"""OpenAI's Responses API (`POST /v1/responses`), stateless: the request, its translation into
a chat completion request (one generation path for both endpoints), and the response's output
items.

What is served: `input` as a string or a list of items (messages of the roles `user`,
`system`, `developer` and `assistant` with text content, `function_call` and
`function_call_output` items from earlier turns; `reasoning` items are accepted and dropped,
since the text they summarize is not needed to continue), `instructions` (a system message
first), `max_output_tokens`, `temperature`, `top_p`, function `tools` (and `namespace` tools
of functions) with `tool_choice` and
`parallel_tool_calls`, `text.format` (`text`, `json_object`, `json_schema`: structured output),
`stream`, the output text's log-probabilities (`include: ["message.output_text.logprobs"]`,
`top_logprobs`), and the looped-model fields of chat completions (`min_loops`, `max_loops`,
`exit_threshold`). Accepted and asking nothing different: `reasoning` (its effort ignored),
`include: ["reasoning.encrypted_content"]` (there is none to include) and
`client_metadata`. Nothing is stored: `store` true, `previous_response_id` and `conversation`
are 400s naming the field (send the whole conversation in `input`), as are other tools (web
search, files, ...), images and other fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from loopserve.server.protocol_chat import metadata_within_sizes, nothing_stored


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as `protocol._Request`


class TextPart(_Request):
    """Text content of an input message (`input_text`), or of an assistant message sent back
    (`output_text`, with the annotations and log-probabilities OpenAI returned)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _joined(content: str | list[TextPart]) -> str:
    """A string, or its text parts' text in order."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Request):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    namespace: str | None = None  # the call's `NamespaceTool`, if any
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    """The result of an earlier call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.output)


class ReasoningItem(_Request):
    """An earlier turn's reasoning, sent back by clients that keep the whole output: dropped
    (the next turn needs the answer, not the thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(value: Any) -> str:
    """A message may leave out `type` (OpenAI's "easy" input message)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "")
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Request):
    """Function tools grouped under a name (OpenAI's `namespace` tool; Codex sends its
    sub-agent tools as one). Each is offered to the model as a function of its own, and a
    call to one names its namespace (`function_call.namespace`)."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


Tool = Annotated[FunctionTool | NamespaceTool, Field(discriminator="type")]


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ReasoningConfig(_Request):
    """`reasoning`, as agent CLIs send it (Codex: `{"summary": "auto"}`). A reasoning item
    carries the model's reasoning text as the reasoning parser splits it, never a summary, so
    `summary` asks for nothing this server does differently. `effort` is accepted and
    ignored, as vLLM does for a model that reads none: a looped model's depth per token is
    set by its exit policy and a request's `min_loops`, `max_loops` and `exit_threshold`."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    # What else to return: the output text's log-probabilities, with `top_logprobs`.
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    # Fields that ask nothing of generation (as in chat completions).
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    client_metadata: dict[str, str] | None = None  # Codex's turn metadata
    # Looped-model extensions.
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None

    @field_validator("store")
    @classmethod
    def _nothing_is_stored(cls, store: bool | None) -> bool | None:
        return nothing_stored(store, "responses")

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return metadata_within_sizes(metadata)

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _no_stored_state(cls, value: object) -> object:
        if value is not None:
            raise ValueError(
                "this server keeps no responses or conversations: send the whole "
                "conversation in input"
            )
        return value

    @field_validator("include")
    @classmethod
    def _what_can_be_included(cls, include: list[str] | None) -> list[str] | None:
        other = [name for name in include or () if name not in INCLUDABLE]
        if other:
            raise ValueError(f"this server returns none of {other} (only {sorted(INCLUDABLE)})")
        return include

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_them_included(cls, top: int | None, info) -> int | None:
        if top is not None and LOGPROBS not in (info.data.get("include") or ()):
            raise ValueError(f"top_logprobs needs include: [{LOGPROBS!r}]")
        return top

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not value:
            raise ValueError("input needs at least one item")
        return value

    def chat_fields(self) -> dict[str, Any]:
        """The equivalent chat completion request's fields (`ChatCompletionRequest`)."""
        fields: dict[str, Any] = {"messages": self.messages(), "stream": self.stream}
        for name in ("model", "temperature", "top_p", "min_loops", "max_loops",
                     "exit_threshold", "user"):  # fmt: skip
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            fields["max_completion_tokens"] = self.max_output_tokens
        if self.wants_logprobs:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.top_logprobs or 0
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": function.model_dump(exclude={"type"}, exclude_none=True),
                }
                for function, _ in self.functions()
            ]
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        fmt = None if self.text is None else self.text.format
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema: dict[str, Any] = {"name": fmt.name or "response"}
            if fmt.schema_ is not None:
                schema["schema"] = fmt.schema_
            if fmt.strict is not None:
                schema["strict"] = fmt.strict
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return fields

    def functions(self) -> list[tuple[FunctionTool, str | None]]:
        """Every function tool, a namespace's flattened in order, with its namespace's name."""
        out: list[tuple[FunctionTool, str | None]] = []
        for tool in self.tools or ():
            if isinstance(tool, NamespaceTool):
                out += [(function, tool.name) for function in tool.tools]
            else:
                out.append((tool, None))
        return out

    def namespace_of(self, name: str) -> str | None:
        """The namespace of the function called `name` (None: a top-level function)."""
        return next((ns for function, ns in self.functions() if function.name == name), None)

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages: consecutive function calls join the
        assistant message before them (or one of their own), each output is a tool message."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, InputMessage):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out


LOGPROBS = "message.output_text.logprobs"  # the output text's log-probabilities
# What a stateless client asks for to send reasoning back (Codex, the Agents SDK with
# `store` false): this server keeps nothing hidden, so its reasoning items carry no
# encrypted content, and the items sent back are dropped (`ReasoningItem`).
ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDABLE = frozenset({LOGPROBS, ENCRYPTED_REASONING})

# Where a chat completion field's error points in the Responses request.
CHAT_TO_RESPONSES_PARAM = {
    "logprobs": "include",
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}
