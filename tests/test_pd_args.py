"""`loopserve serve --pd prefill=P,decode=Q`: the spec parser and its CLI errors (no Ray)."""

from __future__ import annotations

import argparse

import pytest

from loopserve.cli.main import main
from loopserve.distributed.args import PDSpec, parse_pd_spec, resolve_prefill_mode, uses_ray


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("prefill=1,decode=1", PDSpec(1, 1)),
        ("decode=3,prefill=2", PDSpec(2, 3)),
        (" prefill = 2 , decode=1 ", PDSpec(2, 1)),
    ],
)
def test_pd_spec_parses_both_roles_in_any_order(text, spec):
    assert parse_pd_spec(text) == spec
    assert str(spec) == f"prefill={spec.num_prefill},decode={spec.num_decode}"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("prefill=1", "decode missing"),
        ("decode=2", "prefill missing"),
        ("prefill=0,decode=1", "prefill must be >= 1"),
        ("prefill=1,decode=-2", "decode must be >= 1"),
        ("prefill=1,decode=two", "decode='two' is not a whole number"),
        ("prefill=1,decode=1,prefill=2", "prefill is given twice"),
        ("prefill=1,encode=1", "unknown role 'encode'"),
        ("1P1D", "'1P1D' is not role=count"),
        ("", "'' is not role=count"),
    ],
)
def test_bad_pd_spec_says_what_is_wrong(text, says):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse_pd_spec(text)
    assert says in str(err.value)
    assert "expected prefill=P,decode=Q" in str(err.value)


def test_serve_with_a_bad_pd_spec_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--pd", "prefill=0,decode=1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --pd" in err and "prefill must be >= 1" in err


def test_pd_and_data_parallel_size_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--pd", "prefill=1,decode=1", "--data-parallel-size", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--pd prefill=1,decode=1 and --data-parallel-size 2 exclude each other" in err


def test_pd_refuses_async_scheduling(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--pd", "prefill=1,decode=1", "--async-scheduling", "--exit-mode", "trace"])
    assert exit_info.value.code == 2
    assert "--pd needs --async-scheduling off" in capsys.readouterr().err


def test_pd_alone_serves_on_ray():
    parse = argparse.Namespace
    assert uses_ray(parse(data_parallel_size=1, ray_address=None, pd=PDSpec(1, 1)))
    assert not uses_ray(parse(data_parallel_size=1, ray_address=None, pd=None))


def test_pd_pool_refuses_async_scheduling():
    from loopserve.distributed.pd_pool import PDReplicaPool
    from loopserve.distributed.pool import PoolConfig

    with pytest.raises(ValueError, match="needs async_scheduling off"):
        PDReplicaPool({"async_scheduling": True}, PoolConfig(num_replicas=2), PDSpec(1, 1))


def test_kv_transfer_timeout_must_be_positive_and_reaches_the_pool(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--pd", "prefill=1,decode=1", "--kv-transfer-timeout-s", "0"])
    assert exit_info.value.code == 2
    assert "--kv-transfer-timeout-s must be > 0, got 0.0" in capsys.readouterr().err
    from loopserve.cli.serve import add_cli_args
    from loopserve.distributed.launch import build_pool

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--pd", "prefill=1,decode=1", "--kv-transport", "torch", "--kv-transfer-timeout-s", "7.5"]
    )
    pool = build_pool(args, {"block_size": 4}, lambda err: None)
    assert (pool.kv_transport, pool.kv_transfer_timeout_s) == ("torch", 7.5)


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--kv-handoff", "stream"], "--kv-handoff stream needs --pd"),
        (["--pd", "prefill=1,decode=1", "--kv-handoff", "stream", "--kv-transport", "torch"],
         "--kv-transport torch sends whole hand-offs only"),
    ],
)  # fmt: skip
def test_kv_handoff_stream_needs_pd_and_the_object_store(capsys, flags, says):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_kv_handoff_reaches_the_pool_and_auto_streams_through_the_object_store():
    from loopserve.cli.serve import add_cli_args
    from loopserve.distributed.launch import build_pool

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags = ["--pd", "prefill=1,decode=1", "--kv-handoff", "stream", "--kv-transport", "auto"]
    pool = build_pool(parser.parse_args(flags), {"block_size": 4, "device": "cuda"}, print)
    assert (pool.kv_handoff, pool.kv_transport, pool.streams_kv) == ("stream", "ray", True)
    assert pool.engine_args["prefill_mode"] == "per_depth"  # none given: streaming's arm
    pool = build_pool(parser.parse_args(flags[:2]), {"block_size": 4}, print)
    assert (pool.kv_handoff, pool.streams_kv) == ("whole", False)
    assert pool.engine_args["prefill_mode"] == "atomic"
    given = {"block_size": 4, "prefill_mode": "wavefront"}
    assert build_pool(parser.parse_args(flags), given, print).engine_args == given


def test_streaming_runs_per_depth_prompts_unless_an_arm_is_asked_for():
    """`serve --pd ... --kv-handoff stream` without `--prefill-mode` runs per_depth prompts
    (a chunk's shallow planes leave while it runs its deeper loops) and says so at start-up;
    left out otherwise, or where per_depth cannot help (one K/V per position) or cannot run
    (`--prompt-exits`), the arm is atomic, the engine's default. An explicit atomic arm with
    streaming is kept, with a note on what it costs; an explicit arm is never changed."""
    from loopserve.cli.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    base = ["--pd", "prefill=1,decode=1"]
    stream = [*base, "--kv-handoff", "stream"]

    def resolved(flags: list[str]) -> tuple[str, str | None]:
        args = parser.parse_args(flags)
        note = resolve_prefill_mode(args)
        return args.prefill_mode, note

    mode, note = resolved(stream)
    assert mode == "per_depth" and note is not None and "per_depth" in note
    assert resolved(base) == ("atomic", None)
    assert resolved([]) == ("atomic", None)
    assert resolved([*stream, "--layout", "shared"]) == ("atomic", None)
    assert resolved([*stream, "--prompt-exits"]) == ("atomic", None)
    mode, note = resolved([*stream, "--prefill-mode", "atomic"])
    assert mode == "atomic" and note is not None and "after its last loop" in note
    assert resolved([*stream, "--prefill-mode", "wavefront"]) == ("wavefront", None)
    assert resolved([*base, "--prefill-mode", "per_depth"]) == ("per_depth", None)
