"""The tool-calling parts of the OpenAI protocol (`server/protocol.py` uses them): function
definitions, `tool_choice` naming a function, the calls in a request's history, and the
calls of a response and of its stream deltas (docs/serving.md, "Tool calling")."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as `protocol._Request`


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _FUNCTION_NAME.fullmatch(name):
            raise ValueError("a function name is 1-64 letters, digits, '_' or '-'")
        return name


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]  # {"name", "arguments" (JSON text)}


class DeltaToolCall(BaseModel):
    """A streamed call (OpenAI's incremental shape): `index` says which call of the choice;
    this server sends each call whole in one delta (id, type, name and all arguments)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]
