"""Tool calling: tool definitions into the prompt, generated text into OpenAI `tool_calls`.

A chat request's `tools` reach the model through its chat template: a template that reads
`tools` (Qwen's, Hermes', most recent ones) gets them as the `tools` variable, the history's
assistant `tool_calls` (arguments as objects) and `tool` messages as they are (the Hugging
Face convention). A template that does not (the embedded model's plain ChatML, Ouro's) gets
the Hermes convention spelled out in its messages instead (`render`): a system message that
lists the functions in `<tools></tools>` and asks for each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier calls become that text
in the assistant's content, tool results `<tool_response>` blocks in a user turn.

A parser (`PARSERS`, `--tool-call-parser`; `hermes` reads the `<tool_call>` blocks) turns an
output into (content, calls), whole (`parse`) or as it streams (`ToolCallStream`: text
before a block streams as content, a block is held until it closes and then sent as one
call). A block that is not a JSON object with a known function's `name` stays content.

`tool_choice` `required` or a named function is enforced, not hoped for: `call_grammar` is
a Lark grammar for llguidance (structured output) whose only outputs are such blocks, the
arguments constrained to the function's `parameters` schema, so they always parse. `auto`
leaves the choice to the model and the parser. Torch-free.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from loopserve.errors import InvalidRequestError
from loopserve.text.structured import close_objects

START, END = "<tool_call>", "</tool_call>"
# JSON inside a call block is written as `json.dumps` writes it (the structured-output
# module's rule: no free whitespace for a small model to loop on).
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One function call read from the output: its name and its arguments as JSON text."""

    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry (a fresh id)."""
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _read_call(block: str, names: frozenset[str]) -> ParsedCall | None:
    """The call in one block's text, or None (not a JSON object naming a known function)."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # already JSON text
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ParsedCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Splits streamed output: `feed(delta)` -> (content, calls completed); a start tag cut
    at the delta's end and an open block are held until they can be told apart (`finish`
    returns what is left: an unclosed block as content). Whitespace before any other
    content is held too: beside calls and nothing else (the newline between parallel call
    blocks) it is not content, as a whole output's `parse` has it."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)
        self._held = ""  # text not yet told apart
        self._in_block = False
        self._space = ""  # whitespace held while nothing else is content
        self._said = False  # some content other than whitespace went out
        self._called = False

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        content, calls = self._split(delta)
        self._called = self._called or bool(calls)
        if not self._said:
            if not content.strip():
                self._space += content
                return "", calls
            content, self._space, self._said = self._space + content, "", True
        return content, calls

    def _split(self, delta: str) -> tuple[str, list[ParsedCall]]:
        text, self._held = self._held + delta, ""
        content, calls = [], []
        while text:
            if self._in_block:
                end = text.find(END)
                if end < 0:
                    self._held = text
                    break
                block, text = text[:end], text[end + len(END) :]
                self._in_block = False
                call = _read_call(block.strip(), self.names)
                if call is None:
                    content.append(START + block + END)
                else:
                    calls.append(call)
                continue
            start = text.find(START)
            if start < 0:
                keep = _partial_tag(text)
                content.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            content.append(text[:start])
            text = text[start + len(START) :]
            self._in_block = True
        return "".join(content), calls

    def finish(self, *, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        """What is held, at the output's end. `truncated`: the output was cut at `max_tokens`;
        an open block that has named a known function then is a call cut short, returned
        as OpenAI returns one (its arguments as far as they got, finish reason "length")
        rather than as content with the markup in it."""
        held, self._held = self._held, ""
        rest, calls = held, []
        if self._in_block:
            self._in_block = False
            call = _read_cut_call(held, self.names) if truncated else None
            rest, calls = ("", [call]) if call is not None else (START + held, [])
        space, self._space = self._space, ""
        if not self._said and not rest.strip() and (self._called or calls):
            return "", calls  # only whitespace beside calls: no content
        return space + rest, calls


_CUT_CALL = re.compile(r'\{"name": "([^"\\]+)"(.*)', re.DOTALL)
_ARGUMENTS = ', "arguments": '


def _read_cut_call(block: str, names: frozenset[str]) -> ParsedCall | None:
    """A call in a block `max_tokens` cut (no end tag): whole if its JSON closed, else, once
    it has named a known function as an enforced call does (`call_grammar`), its arguments'
    text so far (empty before they begin)."""
    block = block[: len(block) - _partial_tag(block, END)]  # the end tag begun
    call = _read_call(block.strip(), names)
    if call is not None:
        return call
    match = _CUT_CALL.fullmatch(block.lstrip())
    if match is None or match.group(1) not in names:
        return None
    rest = match.group(2)
    if rest.startswith(_ARGUMENTS):
        return ParsedCall(match.group(1), rest[len(_ARGUMENTS) :])
    return ParsedCall(match.group(1), "") if _ARGUMENTS.startswith(rest) else None


def _partial_tag(text: str, tag: str = START) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True, slots=True)
class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen)."""

    name: str = "hermes"

    def parse(
        self, text: str, names: Iterable[str], *, truncated: bool = False
    ) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole output; content None when only calls remain.
        `truncated`: cut at `max_tokens` (`ToolCallStream.finish`)."""
        stream = ToolCallStream(names)
        content, calls = stream.feed(text)
        rest, cut = stream.finish(truncated=truncated)
        content, calls = content + rest, calls + cut
        if calls and not content.strip():
            return None, calls
        return content, calls

    def stream(self, names: Iterable[str]) -> ToolCallStream:
        return ToolCallStream(names)


PARSERS = {"hermes": HermesToolParser()}


# ---- the prompt ------------------------------------------------------------------------


def template_reads_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads the `tools` variable)."""
    return chat_template is not None and "tools" in chat_template


def system_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes convention's tool instructions, for a template that does not render tools.
    A function's `strict` is a flag to the server, not part of its description: it is left
    out, so a function reads the same over chat completions and the Responses API (whose
    clients send `strict: false` by default)."""
    listed = "\n".join(json.dumps(_described(tool), ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions "
        f"you may call are listed within <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments "
        f'within {START}{END} tags:\n{START}{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}{END}"
    )


def _described(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    if not isinstance(function, dict) or "strict" not in function:
        return tool
    return {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}


def render(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. `messages` are OpenAI messages as plain dicts
    (`content` text, `tool_calls` with JSON-text arguments, `tool_call_id`). `native`: the
    template reads tools (`template_reads_tools`): calls' arguments become objects, the rest
    goes through unchanged, and `tools` is passed on. Otherwise the Hermes convention is
    written into the messages and no `tools` variable is passed."""
    if native:
        out = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {**call, "function": {**call["function"],
                                          "arguments": _arguments(call["function"])}}
                    for call in message["tool_calls"]
                ]  # fmt: skip
            out.append(message)
        return out, tools or None
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                START + json.dumps({"name": call["function"]["name"],
                                    "arguments": _arguments(call["function"])},
                                   ensure_ascii=False) + END
                for call in message["tool_calls"]
            ]  # fmt: skip
            content = "\n".join([content, *blocks] if content else blocks)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
    if tools:
        instructions = system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, None


def _arguments(function: dict[str, Any]) -> Any:
    """A history call's arguments as an object (they arrive as JSON text)."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            raise InvalidRequestError(
                f"tool call arguments of {function.get('name')!r} are not JSON: {arguments[:80]!r}",
                param="messages",
            ) from None
    return arguments


# ---- enforced calls --------------------------------------------------------------------


def call_grammar(tools: list[dict[str, Any]], name: str | None, *, parallel: bool) -> str:
    """A Lark grammar (llguidance) whose outputs are call blocks: of the function `name`, or
    of any of `tools` (None: `tool_choice` `required`); one block, or with `parallel` one or
    more, one per line. Each block is `{"name": ..., "arguments": ...}` with the arguments
    valid under the function's `parameters` schema (any object without one), bounded by
    `closed`."""
    functions = [tool["function"] for tool in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
    alternatives = []
    for function in functions:
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": closed(function.get("parameters") or {"type": "object"}),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": _JSON_STYLE,
        }
        alternatives.append("%json " + json.dumps(schema))
    # Parallel calls: one or more, at most one per tool (a small model would otherwise go
    # on calling until max_tokens); a named function is called once.
    most = len(functions) if parallel and name is None else 1
    start = "start: call" + ' ("\\n" call)?' * (most - 1)
    call = f'call: "{START}" body "{END}"'
    return "\n".join([start, call, "body: " + " | ".join(alternatives)])


JSON_SAFE_INTEGER = 2**53 - 1


def closed(schema: Any) -> Any:
    """`schema` bounded where it leaves a model room to write until `max_tokens`: its objects
    closed (`close_objects`) and every integer without bounds given the JSON-safe range,
    +-(2**53 - 1) (at most 16 digits)."""
    return _bound_integers(close_objects(schema))


def _bound_integers(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_bound_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        values_not_schemas = key in ("enum", "const", "default", "examples", "required")
        out[key] = value if values_not_schemas else _bound_integers(value)
    if out.get("type") == "integer":
        out = {"minimum": -JSON_SAFE_INTEGER, "maximum": JSON_SAFE_INTEGER, **out}
    return out
