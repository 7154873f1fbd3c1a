"""Text at the server's edge, through a real server process: huge prompts are processed off the
event loop (`/health` and a running stream keep going), and the stop-string limits are 400s.

The server runs with a context of 2,000,000 tokens so that a 1.2 MB prompt passes the character
pre-check and is really tokenized (about 340 k tokens, a second or more of work per prompt on
a 2-core machine), then rejected by the KV cache's capacity. The bounds are behaviour bounds (see `STALL_SHARE`), scaled by how long
the huge prompts took so that they hold on a loaded 2-core machine.
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import re
import threading
import time

import pytest

from tests.optional import require

require("serve")
import httpx

from tests.server_utils import ServerProcess, sse_payloads, wait_all_blocks_free

HUGE_PROMPT_CHARS = 1_200_000
# Whether prompts are tokenized off the event loop is checked by thread, not by time
# (`test_prompts_are_rendered_and_tokenized_in_worker_threads`): a bound on /health latency
# failed on a fast host, where the huge prompts were done before three polls.
FLAGS = [
    "--dtype", "float32", "--num-blocks", "512", "--block-size", "16",
    "--served-model-name", "tiny", "--max-model-len", "2000000",
    "--max-body-bytes", "20000000", "--log-level", "warning",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_tok_dir, tmp_path_factory):
    # A context far past the tiny model's 4,096 positions lets the huge prompts through the
    # length check, so that they are tokenized and then refused for KV capacity: opted in.
    proc = ServerProcess(
        ["--model", str(tiny_tok_dir), *FLAGS],
        tmp_path_factory.mktemp("srv") / "server.log",
        env={"LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def huge_text(seed_words: str) -> str:
    words = seed_words.split()
    repeats = HUGE_PROMPT_CHARS // (len(seed_words) + 1) + 1
    return " ".join(words * repeats)[:HUGE_PROMPT_CHARS]


def test_huge_prompts_do_not_stall_health_or_a_running_stream(server: ServerProcess) -> None:
    url = server.base_url
    chunk_times_s: list[float] = []
    first_chunk = threading.Event()
    stop_reading = threading.Event()
    statuses: list[int] = []

    def read_stream() -> None:
        body = {
            "model": "tiny", "prompt": "the loop", "max_tokens": 1500, "stream": True,
            "temperature": 0.0, "ignore_eos": True,
        }  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            statuses.append(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data:"):
                    chunk_times_s.append(time.monotonic())
                    first_chunk.set()
                if stop_reading.is_set():
                    break

    huge_results: list[httpx.Response] = []

    def send_huge(path: str, body: dict) -> None:
        huge_results.append(httpx.post(url + path, json=body, timeout=300))

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first_chunk.wait(60), f"the stream produced no token: {statuses}"
    text = huge_text("the quick brown fox jumps over the lazy dog and the café")
    senders = [
        threading.Thread(
            target=send_huge, args=("/v1/completions", {"prompt": text, "max_tokens": 4})
        ),
        threading.Thread(
            target=send_huge, args=("/v1/completions", {"prompt": "Q: " + text, "max_tokens": 4})
        ),
        threading.Thread(
            target=send_huge,
            args=("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ),
    ]
    for sender in senders:
        sender.start()
    health_polls = 0
    while any(sender.is_alive() for sender in senders):
        # a stalled event loop fails this (the wait only bounds the test; no speed is asserted)
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        health_polls += 1
        time.sleep(0.05)
    chunks_before = len(chunk_times_s)
    deadline_s = time.monotonic() + 60  # bounds the wait; not a speed assertion
    while len(chunk_times_s) == chunks_before and time.monotonic() < deadline_s:
        time.sleep(0.05)
    stop_reading.set()
    reader.join(60)

    assert [r.status_code for r in huge_results] == [400, 400, 400], [
        r.text[:300] for r in huge_results
    ]
    # Tokenized, then refused for KV capacity: the text really went through the tokenizer.
    messages = [r.json()["error"]["message"] for r in huge_results]
    assert all(re.search(r"prompt has \d+ tokens|needs \d+ KV blocks", m) for m in messages)
    assert health_polls >= 1
    assert len(chunk_times_s) > chunks_before, "the running stream did not go on"
    wait_all_blocks_free(url)


def test_stop_string_limits_are_400s(server: ServerProcess) -> None:
    url = server.base_url
    many = [f"stop{i}" for i in range(30_000)]
    for path, body in [
        ("/v1/completions", {"prompt": "the loop", "max_tokens": 4, "stop": many}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": many}),
    ]:
        response = httpx.post(url + path, json=body, timeout=60)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["param"] == "stop" and "too many stop strings: 30000" in error["message"]
    long = {"prompt": "the loop", "max_tokens": 4, "stop": ["x" * 2049]}
    response = httpx.post(url + "/v1/completions", json=long, timeout=60)
    assert response.status_code == 400 and "2049 characters" in response.json()["error"]["message"]
    ok = {"prompt": "the loop", "max_tokens": 4, "stop": ["zz"] * 32, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=ok, timeout=60) as response:
        assert response.status_code == 200
        payloads = sse_payloads(list(response.iter_lines()))
    assert payloads[-1] == "[DONE]"


def test_the_checkpoints_exit_threshold_completes_the_request_defaults():
    """`serve` fills `exit_threshold` for requests that send none from the checkpoint's
    `early_exit_threshold` (the embedded model states 0.5, what the quick start uses);
    `--request-defaults` wins; a checkpoint that states none keeps the engine's default.
    (`serve` applying it is checked in tests/test_model_ids.py, whose served snapshot is the
    embedded model.)"""
    from loopserve.models.config import read_config_json
    from loopserve.models.tiny import DEFAULT_MODEL_DIR
    from loopserve.server.args import with_checkpoint_defaults

    embedded = read_config_json(DEFAULT_MODEL_DIR / "config.json")
    assert with_checkpoint_defaults({}, embedded) == {"exit_threshold": 0.5}
    assert with_checkpoint_defaults({"exit_threshold": 1.0}, embedded) == {"exit_threshold": 1.0}
    assert with_checkpoint_defaults({"min_loops": 2}, {}) == {"min_loops": 2}


def test_prompts_are_rendered_and_tokenized_in_worker_threads(tiny_tok_dir, monkeypatch):
    """Completion and chat prompts are tokenized in the event loop's worker threads, never on
    the thread that runs the event loop (or the engine's): what keeps /health and running
    streams answering while a huge prompt is tokenized, checked by thread, not by time."""
    from loopserve.engine.llm_engine import LLMEngine
    from loopserve.text.tokenizer import Tokenizer
    from tests.server_utils import in_process_calls

    threads: set[str] = set()
    encode = Tokenizer.encode

    def recording_encode(self, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", recording_encode)
    engine = LLMEngine.from_engine_args(model=str(tiny_tok_dir), dtype="float32", num_blocks=32)
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1}

    async def calls(client):
        return [
            await client.post("/v1/completions", json={"prompt": "a red fox", "max_tokens": 1}),
            await client.post("/v1/chat/completions", json=chat),
        ]

    responses = in_process_calls(engine, "tiny", calls)
    assert [r.status_code for r in responses] == [200, 200]
    assert threads and threading.main_thread().name not in threads  # the loop's thread
    assert all(name.startswith("asyncio") for name in threads), threads  # its worker pool
