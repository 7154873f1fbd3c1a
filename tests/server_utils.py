"""Helpers for tests that run a real `loopserve` server process on a free local port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m loopserve.cli.serve` with the given flags, logging to a file
    (`module` names another entry point with the same flags, e.g. `tests.fault_runner`;
    `console_script=True` runs the installed `loopserve serve` command instead, as a user
    starts it)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        *,
        torch_threads: int = 1,
        env: dict[str, str] | None = None,
        module: str = "loopserve.cli.serve",
        console_script: bool = False,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(
            os.environ, OMP_NUM_THREADS=str(torch_threads), PYTHONUNBUFFERED="1", **(env or {})
        )
        if module.startswith("tests."):  # importable from the repository root
            root = str(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", module]
        if console_script:  # the venv's `loopserve` beside this interpreter
            command = [str(Path(sys.executable).parent / "loopserve"), "serve"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def sse_payloads(lines: list[str]) -> list[dict | str]:
    """The `data:` payloads of an SSE body: parsed JSON objects, and the literal "[DONE]"."""
    out: list[dict | str] = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def prometheus_values(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, from Prometheus text."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metrics(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    response = httpx.get(base_url + "/metrics", timeout=10.0, headers=headers)
    return prometheus_values(response.text)


def wait_all_blocks_free(base_url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """Poll /metrics until no request holds KV blocks; returns the last sample."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        values = metrics(base_url)
        idle = values["loopserve_num_requests_running"] == 0
        if idle and values["loopserve_kv_blocks_free"] == values["loopserve_kv_blocks_total"]:
            return values
        if time.monotonic() > deadline_s:
            raise AssertionError(f"KV blocks still held after {timeout_s} s: {values}")
        time.sleep(0.05)


def in_process_calls(engine, model_name: str, calls, **app_options):
    """Serve `engine` in-process (its `AsyncLLM` behind the OpenAI app, over an ASGI
    transport) and return `await calls(client)`, an httpx client at "http://t".
    `app_options`: `build_app`'s keyword arguments."""
    import asyncio

    from loopserve.engine.async_llm import AsyncLLM
    from loopserve.server.api_server import build_app

    async def main():
        async_llm = AsyncLLM(engine)
        async_llm.start()
        assert await async_llm.wait_ready(timeout_s=30)
        transport = httpx.ASGITransport(app=build_app(async_llm, model_name, **app_options))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await calls(client)
        finally:
            await async_llm.shutdown(1.0)

    return asyncio.run(main())


def thinking_model(tiny_tok_dir, tmp_path):
    """A copy of the tokenizer checkpoint whose chat template opens a `<think>` block in the
    generation prompt (the answer starts inside it)."""
    import json
    import shutil

    model_dir = tmp_path / "thinking"
    shutil.copytree(tiny_tok_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    assert "<think>" in config["chat_template"]
    config_path.write_text(json.dumps(config))
    return model_dir


def recorded_requests(name: str) -> list[dict]:
    """What a client sent, recorded in tests/fixtures/`name` (scripts/agents_tools.py
    `--record`): one JSON line per request, its path and body."""
    path = Path(__file__).parent / "fixtures" / name
    return [json.loads(line) for line in path.read_text().splitlines()]


async def replay(client: httpx.AsyncClient, entries: list[dict], model: str) -> list:
    """Each recorded request posted again, in order, naming `model`: the responses."""
    return [
        await client.post(entry["path"], json={**entry["body"], "model": model})
        for entry in entries
    ]
