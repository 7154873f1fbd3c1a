"""The `loopserve` command line: lazy help, flag help/defaults, the engine-argument table,
argument errors, output spellings, progress bars and the simulate capacity line."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loopserve.cli.main import COMMANDS, build_parser, main
from loopserve.config import CacheConfig, EngineConfig, ExitConfig, SchedulerConfig
from loopserve.engine_args import ENGINE_ARGS, add_engine_args, engine_args_from
from loopserve.sim.report import format_capacity
from loopserve.workloads.args import show_progress

ROOT = Path(__file__).resolve().parents[1]

# Imports `torch` / `fastapi` fail in the child; then every --help must still work.
BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "fastapi", "uvicorn"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from loopserve.cli.main import main
try:
    main(sys.argv[1:] + ["--help"])
except SystemExit as exit_:
    code = exit_.code
else:
    code = None
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fastapi", "uvicorn"))
print("EXIT", code, "HEAVY", heavy)
"""


@pytest.mark.parametrize(
    "path", [(), ("bench",), *[c.path for c in COMMANDS]], ids=lambda p: " ".join(p) or "top"
)
def test_help_imports_neither_torch_nor_fastapi(path):
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, *path],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "EXIT 0 HEAVY []" in done.stdout, done.stdout + done.stderr
    assert "usage: loopserve" in done.stdout


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    parsers = list(_all_parsers(build_parser()))
    assert len(parsers) == 1 + 1 + len(COMMANDS)  # top, bench, every command
    checked = 0
    for parser in parsers:
        text = parser.format_help()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), (parser.prog, action.option_strings)
            default = action.default
            shown = default is not None and default is not False and default != []
            on_off = isinstance(action, argparse._StoreConstAction)
            if action.option_strings and shown and not on_off:
                assert f"(default: {default}" in " ".join(text.split()), (
                    parser.prog,
                    action.option_strings,
                )
            checked += 1
    assert checked > 100


def test_exit_threshold_help_says_one_means_never_early():
    text = " ".join(build_parser(["generate"])._subparsers._group_actions[0]
                    .choices["generate"].format_help().split())  # fmt: skip
    assert "1.0 means never exit early" in text
    assert "(default: 1.0)" in text


def test_engine_table_covers_every_config_field_with_the_same_default():
    groups = {"top": EngineConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
    groups["exit"] = ExitConfig
    reachable = {
        (group, f.name): f.default
        for group, klass in groups.items()
        for f in dataclasses.fields(klass)
        if f.name not in ("cache", "scheduler", "exit")
    }
    table = {(arg.group, arg.field): arg for arg in ENGINE_ARGS}
    assert set(table) == set(reachable)
    for key, value in reachable.items():
        assert table[key].default == value, key
    # Flags: one per table entry, same name, parsed default equal to the config's default.
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert flags == {arg.name for arg in ENGINE_ARGS}
    parsed = engine_args_from(parser.parse_args([]))
    assert EngineConfig.from_engine_args(**parsed) == EngineConfig()
    assert parsed["block_size"] == 16 and parsed["exit_mode"] == "ouro"
    assert parsed["max_num_batched_tokens"] == 2048 and parsed["mixed_prefill_decode"] is False


def test_generate_flags_are_the_engine_table():
    sub = build_parser(["generate"])._subparsers._group_actions[0].choices["generate"]
    dests = {a.dest for a in sub._actions}
    assert {arg.name for arg in ENGINE_ARGS} <= dests


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: loopserve {argv[0]}" in err
    return err


def test_exit_trace_without_trace_mode_is_a_usage_error(capsys):
    err = _usage_error(["generate", "--exit-trace", "1,2"], capsys)
    assert "loopserve generate: error: --exit-trace needs --exit-mode trace" in err


def test_bad_prompt_token_ids_is_an_argparse_error(capsys):
    err = _usage_error(["generate", "--prompt-token-ids", "1,x"], capsys)
    assert "loopserve generate: error: argument --prompt-token-ids" in err


def test_serve_takes_its_model_positionally_as_vllm_serve_does(tmp_path, capsys):
    """`loopserve serve MODEL` is `--model MODEL`: the positional reaches the model lookup (a
    missing one is named in one line; run as a subprocess, where a positional ignored would
    serve the embedded model until the timeout), the same model both ways is fine, two
    different ones are a usage error naming both."""
    missing = tmp_path / "no-such-model"
    for tail in ([], ["--model", str(missing)]):
        done = subprocess.run(
            [sys.executable, "-m", "loopserve.cli.main", "serve", str(missing), *tail],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.strip() == (
            f"loopserve serve: error: model '{missing}' is neither a local directory nor a Hub id"
        )
    err = _usage_error(["serve", "acme/a", "--model", "acme/b"], capsys)
    assert "loopserve serve: error: two models: 'acme/a' (positional) and --model 'acme/b'" in err


def test_serve_hands_replicas_the_chat_templates_text_not_its_path(tmp_path):
    """What `serve` checks before it starts (`check_before_start`) leaves `--chat-template`
    as the template's text, so a Ray replica on another node (without the file) renders the
    same prompts; a missing file is the error's one line instead."""
    from loopserve.cli.serve import add_cli_args, check_before_start
    from loopserve.distributed.args import resolve_prefill_mode

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--chat-template", str(path)])
    resolve_prefill_mode(args)  # as main_from_args does first
    assert check_before_start(args) is None
    assert args.chat_template == template
    missing = parser.parse_args(["--chat-template", str(tmp_path / "gone.jinja")])
    resolve_prefill_mode(missing)
    assert "is neither a file nor a Jinja template" in check_before_start(missing)


@pytest.mark.parametrize(
    ("flag", "value", "span"),
    [
        ("--port", "99999", "in 1..65535"),  # uvicorn's bind raised OverflowError and aborted
        ("--default-max-tokens", "0", ">= 1"),
        ("--max-connections", "0", ">= 1"),  # every connection would be beyond it
        ("--max-pending-requests", "0", ">= 1"),  # every request would get 429
        ("--max-body-bytes", "0", ">= 1"),
        ("--header-timeout-s", "nan", ">= 0.001"),
        ("--body-timeout-s", "0", ">= 0.001"),
        ("--body-deadline-s", "-5", ">= 0.001"),
        ("--torch-threads", "0", ">= 1"),
        ("--shutdown-timeout-s", "-1", ">= 0"),
    ],
)
def test_serve_flags_out_of_range_are_usage_errors(flag, value, span, capsys):
    """A server flag whose value the server cannot work with is argparse's error naming the
    flag and its range (exit 2 before anything starts), not a crash at bind or a server
    that refuses everything. (`--max-num-seqs 0` is a tripwire: were the flag accepted, the
    engine's check would end the command there instead of a server starting in the test.)"""
    err = _usage_error(["serve", flag, value, "--max-num-seqs", "0"], capsys)
    assert f"loopserve serve: error: argument {flag}: must be {span}, got {value}" in err


def test_exit_trace_above_the_models_loops_is_a_usage_error(tmp_path, capsys):
    from loopserve.models.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path, seed=3, total_ut_steps=3, with_tokenizer=True)
    argv = ["generate", "--model", str(model), "--dtype", "float32", "--num-blocks", "32"]
    argv += ["--exit-mode", "trace", "--no-progress", "--max-tokens", "2"]
    err = _usage_error([*argv, "--exit-trace", "1,4"], capsys)
    assert "error: --exit-trace values must be in 1..3" in err
    assert main([*argv, "--exit-trace", "1,3", "--json", "--prompt-token-ids", "5,6"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["exit_depths"] == [1, 3]


def test_output_locations_have_one_spelling_and_old_ones_still_parse():
    for path, option in [
        (("bench", "throughput"), "--output-json"),
        (("bench", "wcpb"), "--output-json"),
        (("bench", "interference"), "--output-json"),
        (("bench", "serve"), "--output-dir"),
        (("simulate",), "--output-dir"),
    ]:
        parser = build_parser(list(path))
        args = parser.parse_args([*path, option, "x1"])
        dest = option[2:].replace("-", "_")
        assert getattr(args, dest) == "x1"
        old = "--out" if option == "--output-json" else "--out-dir"
        assert getattr(parser.parse_args([*path, old, "x2"]), dest) == "x2"
        assert old + " " not in build_parser(list(path)).format_help()


def test_bench_serve_defaults_are_cpu_sized():
    args = build_parser(["bench", "serve"]).parse_args(["bench", "serve"])
    assert args.dataset == "random" and args.num_prompts == 32
    assert args.num_prompts * (args.random_input_len + args.random_output_len) == 32 * 160


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_when_stderr_is_a_terminal(monkeypatch):
    on, off = argparse.Namespace(no_progress=False), argparse.Namespace(no_progress=True)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert show_progress(on) is False
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert show_progress(on) is True
    assert show_progress(off) is False


def test_capacity_line_says_at_least_when_the_top_rate_met_the_slo():
    assert format_capacity("refill", 8.0, 8.0) == "capacity      refill: ≥ 8.000 req/s"
    assert format_capacity("refill", 4.5, 8.0) == "capacity      refill: 4.500 req/s"
    assert format_capacity("refill", 0.0, 8.0) == "capacity      refill: 0.000 req/s"


def test_simulate_prints_at_least_when_every_rate_meets_the_slo(tmp_path, capsys):
    argv = ["simulate", "--dataset", "synthetic", "--num-requests", "20", "--input-len", "32"]
    argv += ["--output-len", "16", "--request-rate", "0.5", "1", "--slo-ms", "1000"]
    argv += ["--no-plot", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "capacity      refill: ≥ 1.000 req/s" in out
    assert json.loads((tmp_path / "simulate.json").read_text())["capacity_req_s"] == {"refill": 1.0}


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / "loopserve" / package).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return found


def test_tools_import_one_way():
    bench, sim, workloads = _imports("bench"), _imports("sim"), _imports("workloads")
    assert not any(m.startswith(("loopserve.sim", "loopserve.cli")) for m in bench)
    assert not any(m.startswith(("loopserve.bench", "loopserve.cli")) for m in sim)
    assert not any(
        m.startswith(("loopserve.bench", "loopserve.sim", "loopserve.cli")) for m in workloads
    )
    assert any(m.startswith("loopserve.workloads") for m in bench)
    assert any(m.startswith("loopserve.workloads") for m in sim)


def test_generate_draws_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path, capsys):
    # capsys replaces stderr with a buffer (not a terminal), as a pipe or a log file would.
    from loopserve.models.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path, seed=3, with_tokenizer=True)
    argv = ["generate", "--model", str(model), "--dtype", "float32", "--num-blocks", "32"]
    assert main([*argv, "--max-tokens", "2", "--prompt-token-ids", "5,6"]) == 0
    captured = capsys.readouterr()
    assert "prompt:" in captured.out
    assert "generate:" not in captured.err and "req/s" not in captured.err


def test_simulate_reports_cdb_efficiency_against_its_ceiling(tmp_path, capsys):
    """Offline refill against full depth: the speed-up, the ceiling D / mean loops of the same
    run, and the ceiling with the once-per-token share counted (which lies between 1 and
    the plain ceiling); no early-exit policy can beat either ceiling."""
    argv = ["simulate", "--dataset", "synthetic", "--num-requests", "24", "--input-len", "32"]
    argv += ["--output-len", "24", "--policies", "full_depth", "refill", "no_refill"]
    argv += ["--request-rate", "inf", "--no-plot", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    assert "continuous depth batching against its ceiling" in capsys.readouterr().out
    record = json.loads((tmp_path / "simulate.json").read_text())
    points = {p["policy"]: p["result"] for p in record["points"]}
    cdb = {r["policy"]: r for r in record["cdb_efficiency"]}
    assert set(cdb) == {"refill", "no_refill"}
    refill = cdb["refill"]
    depth = points["full_depth"]["mean_loops_per_token"]
    assert refill["ceiling"] == pytest.approx(depth / points["refill"]["mean_loops_per_token"])
    assert refill["speedup"] == pytest.approx(
        points["refill"]["output_throughput"] / points["full_depth"]["output_throughput"]
    )
    assert 0 < refill["once_share"] < 1
    assert 1 < refill["ceiling_once"] < refill["ceiling"]
    assert refill["speedup"] <= refill["ceiling_once"] * 1.01 and refill["efficiency"] <= 1.01
    assert refill["efficiency"] > cdb["no_refill"]["efficiency"] > 0
