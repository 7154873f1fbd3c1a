"""Loop classes (`--loop-classes`): named loop budgets a request picks by name or by API key;
their fields fill what the request leaves unset, their priority applies, responses and
/metrics name the class; bad configurations are start-up errors, unknown classes 400s."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import json

from tests.optional import require

require("serve")

import pytest

from loopserve.engine.llm_engine import LLMEngine
from loopserve.server.loop_classes import LoopClasses
from tests.server_utils import in_process_calls

CONFIG = {
    "classes": {
        "interactive": {"exit_threshold": 0.05, "max_loops": 2, "priority": -1},
        "standard": {"exit_threshold": 0.6},
        "full": {"exit_threshold": 1.0, "min_loops": 4, "priority": 1},
    },
    "default": "standard",
    "api_keys": {"team-a-key": "interactive"},
}


def test_classes_fill_loop_fields_by_name_key_or_default_and_are_counted(tiny_tok_dir):
    engine = LLMEngine.from_engine_args(model=str(tiny_tok_dir), dtype="float32", num_blocks=64,
                                        scheduling_policy="priority")  # fmt: skip
    classes = LoopClasses.parse(json.dumps(CONFIG))
    base = {"model": "tiny", "prompt": "a red fox", "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    admin = {"Authorization": "Bearer admin"}
    team = {"Authorization": "Bearer team-a-key"}

    async def calls(client):
        post = client.post
        return {
            "full": await post("/v1/completions", json=base | {"loop_class": "full"},
                               headers=admin),
            "key": await post("/v1/completions", json=base, headers=team),
            "default": await post("/v1/completions", json=base, headers=admin),
            "own_bound": await post("/v1/completions",
                                    json=base | {"loop_class": "interactive", "max_loops": 3,
                                                "exit_threshold": 1.0},
                                    headers=admin),
            "chat": await post("/v1/chat/completions", headers=team, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "ignore_eos": True}),
            "unknown": await post("/v1/completions", json=base | {"loop_class": "gold"},
                                  headers=admin),
            "bad_key": await post("/v1/completions", json=base,
                                  headers={"Authorization": "Bearer nope"}),
            "metrics": await client.get("/metrics", headers=admin),
        }  # fmt: skip

    out = in_process_calls(engine, "tiny", calls, loop_classes=classes, api_key="admin")
    depths = {name: out[name].json()["choices"][0]["exit_depths"] for name in
              ("full", "key", "default", "own_bound")}  # fmt: skip
    assert out["full"].json()["loop_class"] == "full" and depths["full"] == [4] * 8
    assert out["key"].json()["loop_class"] == "interactive"
    assert max(depths["key"]) <= 2  # the class's max_loops
    assert out["default"].json()["loop_class"] == "standard"
    assert depths["own_bound"] == [3] * 8  # the request's own fields win over its class's
    assert out["chat"].json()["loop_class"] == "interactive"
    assert out["unknown"].status_code == 400
    assert out["unknown"].json()["error"]["param"] == "loop_class"
    assert out["bad_key"].status_code == 401
    metrics = out["metrics"].text
    for name in ("full", "interactive", "standard"):
        assert f'loopserve_class_requests_total{{loop_class="{name}"}}' in metrics
    full_loops = f'loopserve_class_generation_loops_total{{loop_class="full"}} {4.0 * 8}'
    assert full_loops in metrics


@pytest.mark.parametrize(
    "config, message",
    [
        ({"classes": {"a": {"exit_threshold": 2.0}}}, "exit_threshold"),
        ({"classes": {"a": {"loops": 2}}}, "unknown field"),
        ({"classes": {"a": {}}, "default": "b"}, "default class 'b'"),
        ({"classes": {"a": {}}, "api_keys": {"k": "b"}}, "api key class 'b'"),
        ({"classes": {"a": {"priority": 0.5}}}, "priority"),
        ({"classes": []}, "classes"),
    ],
)
def test_bad_configurations_say_what_is_wrong(config, message):
    with pytest.raises(ValueError, match=message):
        LoopClasses.parse(json.dumps(config))


def test_the_serve_command_refuses_a_bad_loop_class_file(tmp_path, capsys):
    import argparse

    from loopserve.server.args import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    path = tmp_path / "classes.json"
    path.write_text(json.dumps({"classes": {"a": {"min_loops": 0}}}))
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--loop-classes", str(path)])
    assert exited.value.code == 2 and "min_loops" in capsys.readouterr().err


def test_serve_started_as_a_user_starts_it_takes_the_new_flags(tmp_path):
    """`python -m loopserve.cli.serve` with `--loop-classes` (a file), `--tool-call-parser
    none` and `--json-schema-closed`: a request gets its class, `auto` tools are refused
    with the parameter named, a strict-less open schema is closed."""
    import httpx

    from tests.server_utils import ServerProcess

    classes = tmp_path / "classes.json"
    classes.write_text(json.dumps({"classes": {"fast": {"max_loops": 1}}}))
    server = ServerProcess(
        ["--served-model-name", "demo", "--loop-classes", str(classes),
         "--tool-call-parser", "none", "--json-schema-closed"],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        server.wait_healthy()
        url = server.base_url
        fast = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "demo", "prompt": "hi", "max_tokens": 4, "loop_class": "fast",
            "ignore_eos": True}).json()  # fmt: skip
        assert fast["loop_class"] == "fast" and fast["choices"][0]["exit_depths"] == [1] * 4
        tools = [{"type": "function", "function": {"name": "f"}}]
        auto = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": tools},
        )
        assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice"
        schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
        closed = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "demo", "prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": 1,
            "guided_json": schema}).json()  # fmt: skip
        assert set(json.loads(closed["choices"][0]["text"])) == {"a"}
    finally:
        assert server.stop() == 0
    # It serves until it exits: its start-up heap was frozen once the engine loaded.
    assert "froze the start-up heap" in server.log()
