"""Hub model ids: `serve`, `generate`, `eval` and `LLM(...)` take a local directory or a Hub id
found in a Hugging Face cache (at `--revision`, in `--download-dir`); an id that is not there
and cannot be downloaded is one clear line and exit status 2, never a traceback.

The cache is laid out as huggingface_hub lays it out (models--ORG--NAME/blobs, snapshots of
symlinks, refs), built here from the embedded default model and the tiny test checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopserve.errors import ModelLoadError
from loopserve.llm import LLM
from loopserve.models.loader import resolve_model_path
from loopserve.models.tiny import DEFAULT_MODEL_DIR
from loopserve.sampling_params import SamplingParams

REPO_ID = "acme/tiny-ouro"
MAIN_COMMIT = "a" * 40
V1_COMMIT = "b" * 40
LOOPSERVE = str(Path(sys.executable).parent / "loopserve")


def _add_snapshot(repo_dir: Path, commit: str, source: Path, ref: str) -> Path:
    """One snapshot of `source`'s files as huggingface_hub stores it: each file a blob named
    by its hash, the snapshot a directory of relative symlinks, `refs/ref` the commit."""
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_dir) -> Path:
    """A cache holding `acme/tiny-ouro`: main is the embedded default model, v1 the tiny
    test checkpoint (another model, so a revision mix-up changes the tokens)."""
    cache = tmp_path_factory.mktemp("hub")
    repo_dir = cache / ("models--" + REPO_ID.replace("/", "--"))
    _add_snapshot(repo_dir, MAIN_COMMIT, DEFAULT_MODEL_DIR, "main")
    _add_snapshot(repo_dir, V1_COMMIT, tiny_dir, "v1")
    return cache


def _offline_env(cache: Path) -> dict[str, str]:
    return dict(
        os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", LOOPSERVE_ALLOW_DOWNLOAD="1"
    )


def test_a_hub_id_resolves_to_its_cached_snapshot_at_a_revision_and_in_a_download_dir(
    hub_cache, monkeypatch, tmp_path
):
    repo_dir = hub_cache / "models--acme--tiny-ouro"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert resolve_model_path(REPO_ID) == repo_dir / "snapshots" / MAIN_COMMIT
    assert resolve_model_path(REPO_ID, revision="v1") == repo_dir / "snapshots" / V1_COMMIT
    assert resolve_model_path(REPO_ID, revision=V1_COMMIT) == repo_dir / "snapshots" / V1_COMMIT
    # --download-dir: a cache elsewhere is looked up instead of HF_HUB_CACHE
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model_path(REPO_ID, allow_download=False)
    assert resolve_model_path(REPO_ID, download_dir=hub_cache).parent.name == "snapshots"


def test_an_unknown_id_offline_with_downloads_allowed_is_one_model_load_error(hub_cache):
    env = _offline_env(hub_cache)
    code = (
        "from loopserve.models.loader import resolve_model_path\n"
        "resolve_model_path('acme/no-such-model', allow_download=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "ModelLoadError" in done.stderr and "could not be downloaded" in done.stderr


def test_llm_serves_a_cached_hub_id_as_its_directory(hub_cache, monkeypatch, tiny_dir):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    by_id = LLM(REPO_ID, dtype="float32").generate(["Once upon a time"], params)[0]
    by_dir = LLM(str(DEFAULT_MODEL_DIR), dtype="float32").generate(["Once upon a time"], params)
    assert (by_id.token_ids, by_id.exit_depths) == (by_dir[0].token_ids, by_dir[0].exit_depths)
    # revision v1 is the tiny test checkpoint: another model, with its own vocabulary
    v1 = LLM(REPO_ID, revision="v1", dtype="float32", num_blocks=64)
    tiny_vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    default_vocab = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"]
    assert tiny_vocab != default_vocab
    assert v1.engine.model.config.vocab_size == tiny_vocab


def _generate(model: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    argv = [LOOPSERVE, "generate", "--model", model, "--prompt", "Once upon a time"]
    argv += ["--max-tokens", "6", "--temperature", "0", "--json", "--threads", "1", *extra]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)


def _assert_one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_generate_takes_a_cached_hub_id(hub_cache):
    """(That an id runs the same model as its directory is the `LLM` test's; an unknown id
    refused in one line, the serve/eval test's: every command reports it through `main`.)"""
    env = _offline_env(hub_cache)
    by_id = _generate(REPO_ID, env)
    assert by_id.returncode == 0, by_id.stderr
    assert len(json.loads(by_id.stdout)["token_ids"]) == 6


def test_serve_takes_a_cached_hub_id_and_names_it_as_the_model(hub_cache, tmp_path):
    """`loopserve serve ID` with the id positional, as `vllm serve ID` takes it."""
    pytest.importorskip("fastapi", reason="needs the `serve` extra")
    import httpx

    from tests.server_utils import ServerProcess

    server = ServerProcess(
        [REPO_ID, "--dtype", "float32", "--torch-threads", "1"],
        tmp_path / "serve.log",
        console_script=True,
        env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"},
    )
    try:
        server.wait_healthy(timeout_s=120.0)
        models = httpx.get(server.base_url + "/v1/models", timeout=10.0).json()
        assert [m["id"] for m in models["data"]] == [REPO_ID]
        url = server.base_url + "/v1/completions"
        body = {"model": REPO_ID, "prompt": "Once upon a time", "max_tokens": 24,
                "temperature": 0}  # fmt: skip
        response = httpx.post(url, json=body, timeout=60.0)
        assert response.status_code == 200, response.text
        # No exit_threshold sent: the checkpoint's early_exit_threshold (0.5 for the embedded
        # model) is the default, so tokens exit early; 1.0 sent runs all 4 loops.
        assert min(response.json()["choices"][0]["exit_depths"]) < 4
        full = httpx.post(url, json=body | {"exit_threshold": 1.0}, timeout=60.0).json()
        assert full["choices"][0]["exit_depths"] == [4] * 24
    finally:
        assert server.stop() == 0, server.log()


def test_serve_and_eval_refuse_an_unknown_id_offline_in_one_line(hub_cache):
    env = _offline_env(hub_cache)
    for argv in (
        [LOOPSERVE, "serve", "--model", "acme/no-such-model"],
        [LOOPSERVE, "eval", "--model", "acme/no-such-model"],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        _assert_one_line_error(done, "acme/no-such-model")
        assert "could not be downloaded" in done.stderr  # offline, downloads allowed
