"""The shipped Grafana dashboard against a real Prometheus scraping a real `loopserve serve`.

A Prometheus binary from the Debian package (`deploy/prometheus/install.sh` puts one in
.cache/prometheus; one on PATH or in $LOOPSERVE_PROMETHEUS works too; without one the test
skips) scrapes the server on loopback every second while a short bounded load runs (from
its first scrape on); then
every query of every panel of deploy/grafana/loopserve.json is evaluated through
Prometheus's HTTP API and must return data."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.optional import require

require("serve")

import httpx
import pytest

from tests.server_utils import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "loopserve.json"


def _prometheus() -> str | None:
    for candidate in (
        os.environ.get("LOOPSERVE_PROMETHEUS"),
        str(ROOT / ".cache" / "prometheus" / "usr" / "bin" / "prometheus"),
        shutil.which("prometheus"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _queries(served_name: str) -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (panel["title"], target["expr"].replace("$model_name", served_name)
         .replace("$__rate_interval", "20s"))
        for panel in panels for target in panel["targets"]
    ]  # fmt: skip


def _wait_for_a_scrape(api: str) -> None:
    """Until Prometheus has scraped the server once (`up` is 1); bounded, not timed."""
    deadline_s = time.monotonic() + 60
    while time.monotonic() < deadline_s:
        try:
            result = httpx.get(api, params={"query": "up"}, timeout=5).json()["data"]["result"]
        except (httpx.HTTPError, KeyError, ValueError):  # not listening yet
            result = []
        if any(sample["value"][1] == "1" for sample in result):
            return
        time.sleep(0.2)
    raise AssertionError("Prometheus never scraped the server")


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    binary = _prometheus()
    if binary is None:
        pytest.skip("no Prometheus binary (bash deploy/prometheus/install.sh installs one)")
    server = ServerProcess(
        ["--served-model-name", "demo", "--max-num-seqs", "4", "--default-max-tokens", "24",
         "--enable-prefix-caching"],
        tmp_path / "server.log",
    )  # fmt: skip
    prometheus = None
    try:  # Prometheus starts while the server does (it retries the scrape until it is up)
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 500ms}\nscrape_configs:\n  - job_name: loopserve\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]\n"
        )
        log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
        prometheus = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        api = f"http://127.0.0.1:{port}/api/v1/query"
        server.wait_healthy()
        _wait_for_a_scrape(api)  # the load then spans several scrapes
        # A short bounded load over ~2 s (four scrapes): repeated prompts (prefix-cache hits).
        deadline_s = time.monotonic() + 2
        i = 0
        while time.monotonic() < deadline_s:
            body = {"model": "demo", "prompt": "The loop " * 20 + str(i % 3), "max_tokens": 12,
                    "temperature": 0.7, "seed": i, "exit_threshold": 0.5}  # fmt: skip
            response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            i += 1
        time.sleep(1.25)  # two scrapes after the last request
        failures = []
        for title, expr in _queries("demo"):
            result = httpx.get(api, params={"query": expr}, timeout=10).json()
            if result.get("status") != "success" or not result["data"]["result"]:
                failures.append((title, expr, result))
        assert not failures, failures
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(10)
        server.stop()
