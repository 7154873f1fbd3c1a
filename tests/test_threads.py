"""The CPU thread policy every command applies (loopserve/threads.py)."""

from __future__ import annotations

import torch

from loopserve import threads
from loopserve.cli.main import build_parser


def test_flag_then_environment_then_cores_minus_one(monkeypatch):
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    assert threads.resolve_cpu_threads(3) == 3
    assert threads.resolve_cpu_threads(None) == 7
    assert threads.resolve_cpu_threads(0) == 7  # 0: no choice made, the policy decides
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 1)
    assert threads.resolve_cpu_threads(None) == 1
    monkeypatch.setenv(threads.THREADS_ENV, "2")
    assert threads.resolve_cpu_threads(None) is None  # torch already follows OMP_NUM_THREADS
    assert threads.resolve_cpu_threads(5) == 5


def test_applied_on_cpu_only(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert threads.apply_cpu_threads("cuda:0", 3) is None
        assert torch.get_num_threads() == before
        assert threads.apply_cpu_threads("cpu", 2) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_every_model_command_has_a_threads_flag():
    for command, flag in (("generate", "--threads"), ("eval", "--threads"),
                          ("serve", "--torch-threads")):  # fmt: skip
        args = build_parser([command]).parse_args([command, flag, "1"])
        assert getattr(args, flag.lstrip("-").replace("-", "_")) == 1
