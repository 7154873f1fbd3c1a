"""`loopserve eval` on a Huginn checkpoint: fixed step counts, a criterion and its
random-step control."""

from __future__ import annotations

import json

import pytest

from loopserve.eval.cli import main
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def huginn_tok_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(
        tmp_path_factory.mktemp("huginn_tok"), vocab_size=512, with_tokenizer=True
    )


def run_eval(model_dir, tmp_path, *args) -> dict:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "report.json"
    code = main([
        "--model", str(model_dir), "--text-file", str(text), "--seq-len", "12",
        "--max-tokens", "36", "--no-progress", "--output-json", str(out), *args,
    ])  # fmt: skip
    assert code == 0
    return {row["setting"]: row for row in json.loads(out.read_text())["rows"]}


def test_eval_reports_steps_against_quality(huginn_tok_dir, tmp_path, capsys):
    rows = run_eval(huginn_tok_dir, tmp_path, "--steps", "1,8", "--criterion", "kl",
                    "--criterion-thresholds", "0.1")  # fmt: skip
    assert set(rows) == {"r=1", "r=8", "kl<0.1"}
    assert 1 < rows["kl<0.1"]["mean_steps"] < 8  # exits spread over steps
    assert rows["kl<0.1"]["control_ce"] != rows["kl<0.1"]["ce"]
    assert rows["r=1"]["ce"] != rows["r=8"]["ce"]
    assert "random-step CE" in capsys.readouterr().out


def test_positions_that_never_exit_score_as_the_whole_sequence_at_full_depth(
    huginn_tok_dir, tmp_path
):
    """100 stable steps never happen in 8: every position runs 8 steps, one position at a
    time, and must score what the whole sequence scores at once (the two paths agree)."""
    rows = run_eval(huginn_tok_dir, tmp_path, "--steps", "8", "--criterion",
                    "argmax-stability", "--criterion-thresholds", "100")  # fmt: skip
    never = rows["argmax-stability<100"]
    assert never["mean_steps"] == 8
    assert never["ce"] == pytest.approx(rows["r=8"]["ce"], rel=1e-5)
    assert never["control_ce"] == pytest.approx(rows["r=8"]["ce"], rel=1e-5)


def test_eval_rejects_bad_huginn_arguments(huginn_tok_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    base = ["--model", str(huginn_tok_dir), "--text-file", str(text), "--no-progress"]
    assert main([*base, "--steps", "9"]) == 2
    assert "--steps must be in 1..8" in capsys.readouterr().err
    assert main([*base, "--criterion", "none"]) == 2
    assert "--criterion must be one of" in capsys.readouterr().err
