"""Every Ray mode of `loopserve serve` starts from its command line and answers a completion.

Each test runs the installed `loopserve serve` console script as a subprocess on loopback,
as a user starts it (the in-process pool tests never go through the command, which is how
`--data-parallel-size`, `--pd` and `--ray-address` all crashed at start-up with an
AttributeError while the suite stayed green). The answer is compared with one in-process
engine's greedy tokens for the same prompt, so a replica that served something else fails.
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.optional import require

require("ray", "serve")
import httpx

from loopserve.llm import LLM
from loopserve.sampling_params import SamplingParams
from tests.server_utils import ServerProcess, prometheus_values

pytestmark = pytest.mark.slow
ENGINE_FLAGS = ["--dtype", "float32", "--num-blocks", "256", "--block-size", "4"]
PROMPT_IDS = [5, 17, 42, 99, 3]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def expected(tiny_dir) -> list[int]:
    """One in-process engine's greedy tokens for the prompt."""
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate([PROMPT_IDS], params)[0].token_ids


def _complete(server: ServerProcess) -> dict:
    body = {
        "model": "tiny",
        "prompt": PROMPT_IDS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return response.json()


def _serve_and_complete(
    args: list[str],
    tmp_path: Path,
    expected: list[int],
    env: dict[str, str] | None = None,
    metrics_until: Callable[[dict[str, float]], bool] = lambda _: True,
) -> dict:
    """/health before the completion, and `metrics`: /metrics' samples after it, read again
    (every 0.1 s, at most 10 s: the pool's probes refresh replica counters every 0.5 s)
    until `metrics_until` holds for them."""
    server = ServerProcess(
        [*args, *ENGINE_FLAGS, "--served-model-name", "tiny", "--torch-threads", "1"],
        tmp_path / "server.log",
        console_script=True,
        env=env,
    )
    try:
        server.wait_healthy(timeout_s=180.0)
        health = httpx.get(server.base_url + "/health", timeout=5.0).json()
        body = _complete(server)
        for _ in range(100):
            metrics = prometheus_values(httpx.get(server.base_url + "/metrics", timeout=5.0).text)
            if metrics_until(metrics):
                break
            time.sleep(0.1)
    finally:
        code = server.stop()
    log = server.log()
    assert "Traceback" not in log, log
    assert "froze the start-up heap" in log, log  # the router's (its replicas freeze their own)
    assert code == 0, log
    assert body["choices"][0]["token_ids"] == expected
    return {**health, "metrics": metrics}


def test_pd_serve_starts_from_the_command_line(tiny_dir, tmp_path, expected):
    """`--pd prefill=1,decode=1 --kv-handoff stream`, no `--prefill-mode`: streaming runs
    per_depth prompts, so the prompt's complete block goes to the decode replica plane by
    plane, a chunk after each loop, before the hand-off (its chunk counters say so: the
    atomic arm would send the four planes as one chunk);
    the decode replica lands each chunk and the hand-off before importing it (on the host:
    no GPU here)."""
    received = 'loopserve_kv_stream_chunks_total{direction="received",replica="1",role="decode"}'
    landed = 'loopserve_kv_landings_total{replica="1",role="decode",where="%s"}'
    health = _serve_and_complete(
        ["--model", str(tiny_dir), "--pd", "prefill=1,decode=1", "--kv-handoff", "stream"],
        tmp_path,
        expected,
        metrics_until=lambda m: m.get(received, 0) >= 4 and m.get(landed % "host", 0) >= 5,
    )  # fmt: skip
    assert health["replicas"] == 2
    # 5 prompt tokens: one complete block of 4, in each of the tiny model's 4 planes
    assert health["metrics"][received] == 4
    # the 4 chunks and the hand-off, on the host; nothing on a device
    assert (health["metrics"][landed % "host"], health["metrics"][landed % "device"]) == (5, 0)


@pytest.mark.parametrize("transport", ["nixl", "torch"])
def test_pd_serve_with_a_point_to_point_transport_starts_from_the_command_line(
    tiny_dir, tmp_path, expected, transport
):
    """`--pd prefill=1,decode=1 --kv-transport nixl|torch`: the hand-off's K/V goes point to
    point, read over NIXL or sent over a gloo group, and the decode replica's received bytes
    count it (the prefill replica's sent bytes, for torch, the same)."""
    if transport == "nixl":
        pytest.importorskip("nixl", reason="needs NIXL (pip install -e '.[nixl]')")
    received = 'loopserve_kv_transport_bytes_total{direction="received",replica="1",role="decode"}'
    sent = 'loopserve_kv_transport_bytes_total{direction="sent",replica="0",role="prefill"}'
    health = _serve_and_complete(
        ["--model", str(tiny_dir), "--pd", "prefill=1,decode=1", "--kv-transport", transport],
        tmp_path,
        expected,
        # (the probes refresh each replica's counters on their own: wait for the sender's too)
        metrics_until=lambda m: (
            m.get(received, 0) > 0 and (transport == "nixl" or m.get(sent, 0) > 0)
        ),
    )
    assert health["replicas"] == 2 and health["kv_transport"] == transport
    assert health["metrics"][received] > 0
    if transport == "torch":
        assert health["metrics"][sent] == health["metrics"][received]
        assert health["metrics"]["loopserve_kv_transport_fallback"] == 0  # it stayed point to point


def _start_ray_head(log_path: Path) -> tuple[subprocess.Popen, str]:
    """A Ray cluster on loopback in a process of its own (`tests/ray_head.py`) and its GCS
    address."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    log = open(log_path, "w")  # noqa: SIM115 - the child holds it
    head = subprocess.Popen(
        [sys.executable, "-m", "tests.ray_head"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
    )  # fmt: skip
    address = head.stdout.readline().strip()  # type: ignore[union-attr]
    assert address, f"the Ray head printed no address:\n{log_path.read_text()}"
    return head, address


def test_data_parallel_serve_joins_an_existing_ray_cluster_from_the_command_line(
    tiny_dir, tmp_path, expected
):
    """`--data-parallel-size 2 --ray-address HOST:PORT`: two replicas on a cluster another
    process started (the embedded cluster's start is the `--pd` test's)."""
    head, gcs_address = _start_ray_head(tmp_path / "ray_head.log")
    # The GCS names the host's interface but listens on every one: join it on loopback.
    address = "127.0.0.1:" + gcs_address.rsplit(":", 1)[1]
    try:
        health = _serve_and_complete(
            ["--model", str(tiny_dir), "--data-parallel-size", "2", "--ray-address", address],
            tmp_path,
            expected,
            # Ray 2.60's `ray.init()` clusters use token auth; a process joining one by
            # address sends the token (~/.ray/auth_token) only in this mode.
            env={"RAY_AUTH_MODE": "token"},
        )
        assert health["replicas"] == 2
    finally:
        head.stdin.close()  # type: ignore[union-attr]
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
