"""Anthropic's Messages API (`POST /v1/messages`): the request, and its translation into a
chat completion request (one generation path for every endpoint).

What is served: `model`, `max_tokens`, `messages` of the roles `user` and `assistant` whose
content is a string or blocks (`text`; `tool_use` in an assistant turn, `tool_result` in a
user turn; `thinking` and `redacted_thinking` blocks sent back are dropped, as the Responses
API's reasoning items are), `system` (a string or text blocks), `stop_sequences`,
`temperature`, `top_p`, `top_k`, client `tools` (`name`, `description`, `input_schema`) with
`tool_choice` (`auto`, `any`, `tool`, `none`, and `disable_parallel_tool_use`), `stream`,
`metadata`, `thinking` `disabled` or `adaptive`, `context_management` that clears thinking,
`output_config.effort` (ignored: see `OutputConfig`), `system` turns inside `messages` (as
Claude Code sends them), `cache_control` marks (accepted; the prefix cache needs no marks),
and the looped-model fields of chat completions (`min_loops`, `max_loops`,
`exit_threshold`). Server tools (web search, code execution, ...), images, documents,
`thinking` enabled and any other field are 400s naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as `protocol._Request`


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Request):
    """A call the model made in an earlier turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Request):
    """The result of an earlier call, for the model to read."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = _joined(self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Request):
    """An earlier turn's thinking, sent back: dropped (the next turn needs the answer)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


class Message(_Request):
    role: Literal["user", "assistant", "system"]  # Claude Code sends system turns too
    content: str | list[Block]

    @field_validator("content")
    @classmethod
    def _blocks_of_its_role(cls, content: str | list, info) -> str | list:
        role = info.data.get("role")
        allowed = {"user": ("text", "tool_result"), "system": ("text",)}.get(
            role, ("text", "tool_use", "thinking", "redacted_thinking"))  # fmt: skip
        wrong = (
            [] if isinstance(content, str) else [b.type for b in content if b.type not in allowed]
        )
        if wrong:
            raise ValueError(f"a {role} turn has no {wrong[0]} blocks")
        return content


class Tool(_Request):
    """A client tool: the model calls it, the client runs it."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Request):
    """`disabled`, or `adaptive` (the model decides; Claude Code's default): a thinking
    model thinks as its chat template has it either way. `enabled` asks for a token budget
    this server does not keep."""

    type: Literal["disabled", "adaptive"]


class ContextEdit(_Request):
    """A context-management edit. Clearing earlier thinking changes nothing here: thinking
    blocks sent back are dropped whatever `keep` says."""

    type: Literal["clear_thinking_20251015"]
    keep: Any = None


class ContextManagement(_Request):
    edits: list[ContextEdit] = Field(default_factory=list)


class OutputConfig(_Request):
    """`output_config.effort` (Claude Code sends one always). Accepted and ignored, as vLLM
    does for a model that reads no effort: a looped model's depth per token is set by its
    exit policy and a request's `min_loops`, `max_loops` and `exit_threshold`."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(_Request):
    user_id: str | None = None


class MessagesRequest(_Request):
    model: str
    max_tokens: int
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Looped-model extensions.
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The equivalent chat completion request's fields (`ChatCompletionRequest`)."""
        fields: dict[str, Any] = {"messages": self.chat_messages(), "stream": self.stream,
                                  "model": self.model, "max_tokens": self.max_tokens}  # fmt: skip
        for name in ("temperature", "top_p", "top_k", "min_loops", "max_loops", "exit_threshold"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.metadata is not None and self.metadata.user_id is not None:
            fields["user"] = self.metadata.user_id
        choice = self.tool_choice
        if self.tools and not (choice is not None and choice.type == "none"):
            fields["tools"] = [
                {"type": "function", "function": {
                    "name": tool.name, "parameters": tool.input_schema,
                    **({} if tool.description is None else {"description": tool.description})}}
                for tool in self.tools
            ]  # fmt: skip
            if choice is not None:
                fields["tool_choice"] = (
                    {"type": "function", "function": {"name": choice.name}}
                    if choice.type == "tool" else {"auto": "auto", "any": "required"}[choice.type]
                )  # fmt: skip
                if choice.disable_parallel_tool_use:
                    fields["parallel_tool_calls"] = False
        return fields

    def chat_messages(self) -> list[dict[str, Any]]:
        """`system` and `messages` as chat messages: an assistant turn's `tool_use` blocks are
        its tool calls, a user turn's `tool_result` blocks tool messages before its text."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": _joined(self.system)})
        for message in self.messages:
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            if message.role == "system":
                out.append({"role": "system", "content": _joined(
                    [b for b in message.content if isinstance(b, TextBlock)])})  # fmt: skip
                continue
            texts = [b.text for b in message.content if isinstance(b, TextBlock)]
            if message.role == "assistant":
                calls = [{"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                    for b in message.content if isinstance(b, ToolUseBlock)]  # fmt: skip
                entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
                if calls:
                    entry["tool_calls"] = calls
                out.append(entry)
                continue
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": block.text()})  # fmt: skip
            if texts or not any(isinstance(b, ToolResultBlock) for b in message.content):
                out.append({"role": "user", "content": "".join(texts)})
        return out


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a message's fields without `max_tokens`."""

    max_tokens: int = 1


# A chat-side 400's field, named as the Messages request names it.
CHAT_TO_MESSAGES_PARAM = {"stop": "stop_sequences", "user": "metadata"}
