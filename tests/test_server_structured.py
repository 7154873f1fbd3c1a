"""Structured output through the API: OpenAI's `response_format` (json_object, json_schema)
on chat and completions, vLLM's guided_json / guided_regex / guided_choice, and 400s for a
schema that does not compile or for two constraints at once."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import json
import re

from tests.optional import require

require("serve", "structured")

from loopserve.engine.llm_engine import LLMEngine
from tests.server_utils import in_process_calls
from tests.test_structured_output import SCHEMA

MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


def _post_all(tiny_tok_dir, posts):
    engine = LLMEngine.from_engine_args(model=str(tiny_tok_dir), dtype="float32", num_blocks=64)

    async def calls(client):
        return await asyncio.gather(
            *(client.post(path, json=body, timeout=60) for path, body in posts)
        )

    return in_process_calls(engine, "tiny", calls)


def test_response_format_and_guided_fields_constrain_the_output(tiny_tok_dir):
    schema_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "temperature": 0.8,
            "seed": 3, "response_format": schema_format}  # fmt: skip
    completion = {"model": "tiny", "prompt": "Verdict:", "max_tokens": 40, "temperature": 0,
                  "response_format": schema_format}  # fmt: skip
    any_object = dict(chat, response_format={"type": "json_object"}, max_tokens=60)
    text_format = dict(chat, response_format={"type": "text"}, max_tokens=8)
    choice = {"model": "tiny", "prompt": "Colour:", "max_tokens": 8,
              "guided_choice": ["red", "green", "blue"]}  # fmt: skip
    regex = {"model": "tiny", "prompt": "Code:", "max_tokens": 12, "temperature": 0.9,
             "seed": 5, "guided_regex": "[0-9]{3}-[a-f]{2}"}  # fmt: skip
    guided_json = dict(completion, response_format=None, guided_json=SCHEMA)
    responses = _post_all(
        tiny_tok_dir,
        [
            ("/v1/chat/completions", chat),
            ("/v1/completions", completion),
            ("/v1/chat/completions", any_object),
            ("/v1/chat/completions", text_format),
            ("/v1/completions", choice),
            ("/v1/completions", regex),
            ("/v1/completions", guided_json),
        ],
    )
    assert [r.status_code for r in responses] == [200] * 7, [r.text for r in responses]
    chat_text = responses[0].json()["choices"][0]["message"]["content"]
    completion_text = responses[1].json()["choices"][0]["text"]
    for text in (chat_text, completion_text, responses[6].json()["choices"][0]["text"]):
        value = json.loads(text)
        assert set(value) == {"answer", "score"} and value["answer"] in ("yes", "no")
    obj = responses[2].json()["choices"][0]
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    else:
        assert obj["message"]["content"].startswith("{")
    assert responses[4].json()["choices"][0]["text"] in ("red", "green", "blue")
    assert re.fullmatch("[0-9]{3}-[a-f]{2}", responses[5].json()["choices"][0]["text"])


def test_constraints_that_cannot_apply_are_400s(tiny_tok_dir):
    bad_schema = {"type": "json_schema",
                  "json_schema": {"name": "x", "schema": {"type": "object",
                                                          "properties": {"a": {"type": "nope"}}}}}  # fmt: skip
    base = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    responses = _post_all(
        tiny_tok_dir,
        [
            ("/v1/chat/completions", dict(base, response_format=bad_schema)),
            ("/v1/chat/completions", dict(base, guided_regex="(ab")),
            ("/v1/chat/completions",
             dict(base, response_format={"type": "json_object"}, guided_choice=["a"])),
            ("/v1/chat/completions", dict(base, response_format={"type": "json_schema"})),
            ("/v1/chat/completions", dict(base, response_format={"type": "xml"})),
        ],
    )  # fmt: skip
    assert [r.status_code for r in responses] == [400] * 5, [r.text for r in responses]
    for response in responses[:4]:
        assert response.json()["error"]["param"] == "response_format", response.text
    assert "nope" in responses[0].json()["error"]["message"]


def test_grammars_that_meet_a_limit_while_generating_are_400s_naming_the_field(tiny_tok_dir):
    """Grammars that compile but meet llguidance's limits only as the output grows (2,001
    choices in a row, a recursive required `$ref`, nested regex repeats) fail their request
    alone, as a 400 naming `response_format` (they were 500s); a sound request in the same
    batch is served."""
    recursive = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    base = {"model": "tiny", "prompt": "Say:", "max_tokens": 12, "temperature": 0}
    responses = _post_all(
        tiny_tok_dir,
        [
            ("/v1/completions", dict(base, guided_choice=[f"option {i}" for i in range(2001)])),
            ("/v1/completions", dict(base, guided_json=recursive)),
            ("/v1/completions", dict(base, guided_regex="a{1000}{1000}")),
            ("/v1/completions", dict(base, guided_choice=["red", "green"])),
        ],
    )
    assert [r.status_code for r in responses] == [400, 400, 400, 200], [r.text for r in responses]
    for response in responses[:3]:
        error = response.json()["error"]
        assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
        assert error["message"].startswith("structured output:"), error
    assert responses[3].json()["choices"][0]["text"] in ("red", "green")


def test_a_grammar_that_must_end_before_min_tokens_is_a_400_naming_min_tokens(tiny_tok_dir):
    """`guided_choice` of one-token answers with `min_tokens` 8: once the answer is out the
    grammar allows only the end, which `min_tokens` forbids; no token can be sampled (a 500
    before)."""
    base = {"model": "tiny", "prompt": "Answer:", "max_tokens": 12, "min_tokens": 8}
    responses = _post_all(
        tiny_tok_dir,
        [
            ("/v1/completions", dict(base, guided_choice=["yes", "no"], temperature=0)),
            ("/v1/completions", dict(base, guided_choice=["yes", "no"], temperature=0.8)),
            ("/v1/completions", dict(base, min_tokens=0, guided_choice=["yes", "no"])),
        ],
    )
    assert [r.status_code for r in responses] == [400, 400, 200], [r.text for r in responses]
    for response in responses[:2]:
        error = response.json()["error"]
        assert error["param"] == "min_tokens" and "before min_tokens (8)" in error["message"]


def test_a_schema_that_admits_no_json_value_is_a_400_and_endpoints_not_served_are_named(
    tiny_tok_dir,
):
    """`{"$ref": "#"}` compiles to an empty language: the output could only be empty text
    (it was served as "", finish_reason stop). An OpenAI endpoint loopserve does not serve is
    a 404 in the OpenAI shape that names it (it was a bare "Not Found")."""
    base = {"model": "tiny", "prompt": "Say:", "max_tokens": 4}
    responses = _post_all(
        tiny_tok_dir,
        [
            ("/v1/completions", dict(base, guided_json={"$ref": "#"})),
            ("/v1/completions", dict(base, guided_json={"type": "object"})),
            ("/v1/embeddings", {"model": "tiny", "input": "hi"}),
            ("/v1/audio/speech", {"model": "tiny", "input": "hi"}),
        ],
    )
    assert [r.status_code for r in responses] == [400, 200, 404, 404], [r.text for r in responses]
    assert "admits no JSON value" in responses[0].json()["error"]["message"]
    for response, path in zip(responses[2:], ("/v1/embeddings", "/v1/audio/speech")):
        error = response.json()["error"]
        assert error["type"] == "not_found_error" and error["code"] == "unsupported_endpoint"
        assert f"POST {path}" in error["message"] and "/v1/chat/completions" in error["message"]


OPEN_SCHEMA = {  # says nothing of other keys: open under JSON Schema
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 20}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
}


def _keys_parse(response) -> bool:
    try:
        value = json.loads(response.json()["choices"][0]["message"]["content"])
    except ValueError:
        return False
    return set(value) == {"answer", "confident"}


def test_strict_and_server_closed_schemas_parse_where_open_ones_do_not():
    """An open object lets the embedded demo model add keys until max_tokens (sampled, 8
    questions: not all parse; none did when written); `strict: true` (OpenAI requires strict schemas closed) and the server's
    `--json-schema-closed` (for clients such as instructor that send open schemas) close it:
    8 of 8 parse with exactly the declared keys."""

    def request(i, strict=None, guided=False):
        question = f"Question {i}: is the sky blue?"
        body = {"model": "tiny", "messages": [{"role": "user", "content": question}],
                "max_tokens": 150, "temperature": 1.0, "seed": i}  # fmt: skip
        if guided:
            return body | {"guided_json": json.dumps(OPEN_SCHEMA)}
        fmt = {"name": "v", "schema": OPEN_SCHEMA} | ({} if strict is None else {"strict": strict})
        return body | {"response_format": {"type": "json_schema", "json_schema": fmt}}

    engine = LLMEngine.from_engine_args(dtype="float32", num_blocks=256, max_num_seqs=8)

    def run(bodies, **options):
        async def calls(client):
            posts = (client.post("/v1/chat/completions", json=b, timeout=60) for b in bodies)
            return await asyncio.gather(*posts)

        return in_process_calls(engine, "tiny", calls, **options)

    open_runs = run([request(i, strict=False) for i in range(8)])
    strict_runs = run([request(i, strict=True) for i in range(8)])
    closed_runs = run([request(i) for i in range(4)] + [request(i, guided=True) for i in range(4)],
                      json_schema_closed=True)  # fmt: skip
    assert sum(map(_keys_parse, open_runs)) < len(open_runs)
    assert all(map(_keys_parse, strict_runs))
    assert all(map(_keys_parse, closed_runs))
