"""Quality-versus-depth evaluation: teacher-forced scores agree with the engine, the exit
rule and the random-depth control are computed as stated, and `loopserve eval` writes its
table, JSON and plot."""

from __future__ import annotations

import json

import pytest
import torch

from loopserve.eval import cli as eval_cli
from loopserve.eval.quality import evaluate, exit_loops
from loopserve.eval.scoring import SequenceScores, score_sequences
from loopserve.exit import ExitRule
from loopserve.llm import LLM
from loopserve.models import load_model
from loopserve.sampling_params import SamplingParams


def _greedy_sequence(llm: LLM, prompt: list[int], threshold: float, num_new: int):
    """Extend `prompt` one token at a time with the engine's FIRST output token.

    Each extension is a fresh request whose prompt is the whole sequence so far, so every
    position ran all loops (prompts run at full depth) and the token's exit depth was chosen
    by the exit rule over those loops' hazards. That is exactly teacher forcing on the
    resulting sequence, where each target is the token the engine produced.
    """
    sequence, logprobs, loops = list(prompt), [], []
    params = SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True, exit_threshold=threshold
    )
    for _ in range(num_new):
        (out,) = llm.generate([list(sequence)], params, use_tqdm=False)
        sequence.append(out.token_ids[0])
        logprobs.append(out.logprobs[0].logprob)
        loops.append(out.exit_depths[0])
    return sequence, logprobs, loops


@pytest.mark.parametrize("threshold", [0.5, 1.0])
def test_teacher_forced_scores_equal_engine_first_token_logprobs_and_exits(tiny_dir, threshold):
    """The engine reports logprobs of output tokens only, and only an output token that comes
    from a prompt has every loop computed at full depth (decode tokens read earlier tokens'
    K/V at their exit depth). So each position is scored by the engine as the first output
    token of a request whose prompt is the sequence up to it; the sequence is built from
    those greedy tokens, and the eval scores the whole sequence in one teacher-forced pass.
    Per position the engine's exit depth must equal the eval's exit rule, and the engine's
    logprob must equal the eval's logprob at that loop."""
    llm = LLM(str(tiny_dir), dtype="float32", num_blocks=128, block_size=8)
    model = load_model(tiny_dir, dtype="float32")
    prompt = torch.randint(3, 512, (5,), generator=torch.Generator().manual_seed(7)).tolist()
    sequence, engine_logprobs, engine_loops = _greedy_sequence(llm, prompt, threshold, 10)

    scores = score_sequences(model, torch.tensor([sequence]))
    scored = slice(len(prompt) - 1, len(sequence) - 1)  # positions whose target is generated
    rule = ExitRule(min_loops=1, max_loops=4, threshold=threshold)
    eval_loops = exit_loops(scores.hazards[:, scored], rule)
    assert eval_loops.tolist() == engine_loops
    picked = scores.target_logprobs[:, scored].gather(0, (eval_loops - 1).unsqueeze(0))[0]
    assert picked.tolist() == pytest.approx(engine_logprobs, abs=2e-4)
    if threshold < 1.0:
        assert min(engine_loops) < 4, "no early exit happened; the test proves nothing"
    else:
        assert set(engine_loops) == {4}

    report = evaluate(
        SequenceScores(scores.target_logprobs[:, scored], scores.hazards[:, scored]),
        thresholds=[threshold], min_loops_list=[1], model="tiny", source="engine",
        num_sequences=1,
    )  # fmt: skip
    expected_ce = -sum(engine_logprobs) / len(engine_logprobs)
    assert report.settings[0].ce == pytest.approx(expected_ce, abs=2e-4)
    assert report.settings[0].mean_loops == pytest.approx(sum(engine_loops) / len(engine_loops))


def test_informative_gate_beats_the_random_depth_control_with_the_same_histogram():
    # Two loops, 200 positions in pairs: an easy one (loop 1 almost right, gate says exit)
    # and a hard one (loop 1 wrong, gate says continue). Threshold 0.5 exits where λ_0 >= 0.5.
    num_pairs = 100
    logprobs_loop1 = torch.tensor([-0.1, -3.0]).repeat(num_pairs)
    logprobs_loop2 = torch.tensor([-0.5, -1.0]).repeat(num_pairs)
    hazards = torch.stack([torch.tensor([0.9, 0.1]).repeat(num_pairs), torch.ones(2 * num_pairs)])
    scores = SequenceScores(torch.stack([logprobs_loop1, logprobs_loop2]), hazards)
    report = evaluate(scores, thresholds=[0.5, 1.0], min_loops_list=[1], model="m", source="s",
                      num_sequences=1, seed=3)  # fmt: skip
    gate, full = report.settings
    assert report.ce_per_loop == pytest.approx([1.55, 0.75])
    assert gate.loop_counts == [num_pairs, num_pairs]
    assert gate.mean_loops == pytest.approx(1.5)
    assert gate.ce == pytest.approx((0.1 + 1.0) / 2)  # easy at loop 1, hard at loop 2
    # Random assignment of the same 100/100 histogram: expected CE (1.55 + 0.75) / 2 = 1.15.
    assert gate.random_depth_ce == pytest.approx(1.15, abs=0.15)
    assert full.mean_loops == 2.0 and full.ce == pytest.approx(0.75)
    assert full.random_depth_ce == pytest.approx(0.75)


def test_min_loops_holds_tokens_whose_cdf_crossed_early():
    hazards = torch.tensor([[0.9, 0.2], [0.9, 0.9], [0.5, 0.5], [1.0, 1.0]])  # [D=4, N=2]
    # position 0 crosses 0.5 at loop 1; position 1: cdf 0.2, 0.92 -> loop 2.
    assert exit_loops(hazards, ExitRule(1, 4, 0.5)).tolist() == [1, 2]
    assert exit_loops(hazards, ExitRule(3, 4, 0.5)).tolist() == [3, 3]
    assert exit_loops(hazards, ExitRule(1, 4, 1.0)).tolist() == [4, 4]


def test_eval_cli_writes_table_json_and_plot(tiny_tok_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out_json = tmp_path / "eval.json"
    argv = ["--model", str(tiny_tok_dir), "--text-file", str(text), "--thresholds", "0.5,1.0",
            "--min-loops", "1,2", "--seq-len", "32", "--output-json", str(out_json)]  # fmt: skip
    plot = tmp_path / "eval.png"
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(plot)]
    except ImportError:
        plot = None
    assert eval_cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "threshold" in table and "random_CE" in table
    report = json.loads(out_json.read_text())
    assert [(s["threshold"], s["min_loops"]) for s in report["settings"]] == [
        (0.5, 1), (1.0, 1), (0.5, 2), (1.0, 2)
    ]  # fmt: skip
    assert report["num_tokens"] == report["num_sequences"] * 32
    full = report["settings"][1]
    assert full["mean_loops"] == 4.0 and full["ce"] == pytest.approx(report["ce_per_loop"][-1])
    assert sum(full["loop_counts"]) == report["num_tokens"]
    assert report["settings"][2]["loop_counts"][0] == 0  # min_loops 2: nobody stops at 1
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_cli_rejects_min_loops_deeper_than_the_model(tiny_tok_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    argv = ["--model", str(tiny_tok_dir), "--text-file", str(text), "--min-loops", "5"]
    assert eval_cli.main(argv) == 2
    assert "--min-loops must be <= 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--batch-size", "0"),
        ("--seq-len", "0"),
        ("--max-tokens", "-5"),
        ("--heldout-percent", "101"),
    ],
)
def test_eval_cli_refuses_a_size_it_cannot_use_naming_the_flag(flag, value, capsys):
    # --batch-size 0 ended in range()'s ValueError traceback after the model had loaded.
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_eval_cli_refuses_a_window_longer_than_the_model_before_scoring(
    tiny_tok_dir, tmp_path, capsys, monkeypatch
):
    # A window is seq_len + 1 tokens; --seq-len 100000 on the embedded model scored one
    # 100,001-token window for minutes instead of saying it cannot be positioned.
    max_length = load_model(str(tiny_tok_dir)).config.max_position_embeddings
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    monkeypatch.setattr(eval_cli, "load_token_windows", _must_not_read_text)
    argv = ["--model", str(tiny_tok_dir), "--text-file", str(text), "--seq-len", str(max_length)]
    assert eval_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--seq-len {max_length} needs windows of {max_length + 1} tokens" in err
    assert f"--seq-len <= {max_length - 1}" in err
    eval_cli.check_window_fits(max_length - 1, max_length)  # the longest window that fits


def _must_not_read_text(*args, **kwargs):
    raise AssertionError("the text was read before the window length was checked")


def test_eval_cli_reports_cross_entropy_per_character_of_the_scored_text(
    tiny_tok_dir, tmp_path, capsys
):
    # The toy BPE spells " the" as one 4-character token, so 400 repeats are 400 tokens:
    # 12 windows of 33 tokens, 12 * 32 = 384 scored targets spelling 4 * 384 = 1536 characters.
    text = tmp_path / "the.txt"
    text.write_text(" the" * 400)
    out_json = tmp_path / "eval.json"
    argv = ["--model", str(tiny_tok_dir), "--text-file", str(text), "--thresholds", "0.5,1.0",
            "--seq-len", "32", "--output-json", str(out_json)]  # fmt: skip
    assert eval_cli.main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["num_tokens"] == 384 and report["num_chars"] == 1536
    assert report["full_depth_ce_per_char"] == pytest.approx(report["ce_per_loop"][-1] / 4)
    gate = report["settings"][0]
    assert gate["ce_per_char"] == pytest.approx(gate["ce"] / 4)
    assert "1536 chars scored (4.000 chars/token)" in table
    assert f"{report['ce_per_loop'][-1] / 4:.4f} nats/char" in table


def test_per_character_cross_entropy_is_unknown_without_a_character_count():
    scores = SequenceScores(torch.tensor([[-1.0, -3.0]]), torch.ones(1, 2))
    with_chars = evaluate(scores, thresholds=[1.0], min_loops_list=[1], model="m", source="s",
                          num_sequences=1, num_chars=8)  # fmt: skip
    assert with_chars.per_char(with_chars.full_depth_ce) == pytest.approx(2.0 * 2 / 8)
    without = evaluate(scores, thresholds=[1.0], min_loops_list=[1], model="m", source="s",
                       num_sequences=1)  # fmt: skip
    assert without.per_char(without.full_depth_ce) is None
    assert without.to_dict()["settings"][0]["ce_per_char"] is None
