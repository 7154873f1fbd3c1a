"""`loopserve serve --pd prefill=P,decode=Q`: the spec parser and its CLI errors (no Ray)."""

from __future__ import annotations

import argparse

import pytest

from loopserve.cli.main import main
from loopserve.distributed.args import PDSpec, parse_pd_spec, stream_hint, uses_ray


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
    pool = build_pool(parser.parse_args(flags[:2]), {"block_size": 4}, print)
    assert (pool.kv_handoff, pool.streams_kv) == ("whole", False)


def test_streaming_under_the_atomic_arm_gets_a_start_up_note():
    """`serve --pd ... --kv-handoff stream` with the atomic prompt arm (the default) logs why
    `--prefill-mode per_depth` hides more; with per_depth, or whole hand-offs, nothing."""
    from loopserve.cli.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    base = ["--pd", "prefill=1,decode=1"]
    note = stream_hint(parser.parse_args([*base, "--kv-handoff", "stream"]))
    assert note is not None and "--prefill-mode per_depth" in note
    per_depth = [*base, "--kv-handoff", "stream", "--prefill-mode", "per_depth"]
    assert stream_hint(parser.parse_args(per_depth)) is None
    assert stream_hint(parser.parse_args(base)) is None
