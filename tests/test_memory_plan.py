"""The CUDA memory plan's arithmetic (pure functions; the profiling itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from loopserve.config import CacheConfig, cuda_kv_budget, resolve_num_blocks
from loopserve.errors import ConfigError

GIB = 1024**3


def test_budget_is_utilization_share_minus_peak_and_graphs():
    # 80 GiB x 0.9 = 72 GiB; minus 3 GiB peak (weights + activations + non-torch) and 1 GiB of
    # graphs leaves 68 GiB.
    budget = cuda_kv_budget(
        total_bytes=80 * GIB, gpu_memory_utilization=0.9, peak_bytes=3 * GIB, graph_bytes=GIB
    )
    assert budget == int(80 * GIB * 0.9) - 4 * GIB
    assert budget == 73014444032


def test_budget_exhausted_names_every_term():
    with pytest.raises(ConfigError) as err:
        cuda_kv_budget(
            total_bytes=1000, gpu_memory_utilization=0.5, peak_bytes=400, graph_bytes=200
        )
    text = str(err.value)
    for term in ("1000", "0.5", "400", "200", "-100", "enforce_eager"):
        assert term in text


def test_profiled_budget_sizes_blocks_after_the_inflight_reserve():
    cache = CacheConfig()
    resolved = resolve_num_blocks(
        cache, bytes_per_block=1000, free_bytes=None, reserved_bytes=2500, budget_bytes=10_000
    )
    assert resolved.num_blocks == 7  # (10000 - 2500) // 1000
    explicit = CacheConfig(kv_cache_bytes=5000)
    assert (
        resolve_num_blocks(
            explicit,
            bytes_per_block=1000,
            free_bytes=None,
            reserved_bytes=2500,
            budget_bytes=10_000,
        ).num_blocks
        == 5
    )  # an explicit byte budget wins and is not reduced


def test_dummy_forward_of_the_profile_runs_the_whole_model(tiny_model, monkeypatch):
    """The profile's dummy forward (prelude, core with self-attention, gate, coda) runs on
    the real model; the CUDA allocator queries are stubbed so it runs on CPU."""
    import torch

    from loopserve.runner import memory_profile

    calls = []
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: calls.append(_n))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 7000)
    seen = {}
    core = tiny_model.core

    def spy(hidden, positions, attn):
        out = core(hidden, positions, attn)
        seen["rows"], seen["out"] = hidden.shape[0], out
        return out

    monkeypatch.setattr(tiny_model, "core", spy)
    peak = memory_profile._forward_peak(tiny_model, 37, torch.device("cpu"))
    assert peak == 6000  # max allocated - allocated before the forward
    assert seen["rows"] == 37 and torch.isfinite(seen["out"]).all()
    assert calls == ["synchronize", "reset_peak_memory_stats", "synchronize"]
    with pytest.raises(RuntimeError, match="CUDA"):
        memory_profile.profile_cuda_memory(
            tiny_model,
            max_num_batched_tokens=8,
            prefill_chunk_size=8,
            max_num_seqs=2,
            max_model_len=32,
            block_size=4,
            graphs=False,
        )


def test_the_profile_runs_every_part_of_a_huginn_model(tmp_path, monkeypatch):
    """The memory plan's dummy pass goes through `LoopedModel.profile_forward`, so a Huginn
    model (prelude and coda attention, a state injected at every step) is profiled like an
    Ouro one: both are `LoopedModel`s, and the stubbed-CUDA peak measurement runs."""
    import torch

    from loopserve.models.family import LoopedModel
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopserve.models.loader import load_model
    from loopserve.runner import memory_profile

    model = load_model(make_tiny_huginn_checkpoint(tmp_path / "h"), dtype="float32")
    assert isinstance(model, LoopedModel)
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 512)
    assert memory_profile._forward_peak(model, 19, torch.device("cpu")) == 512
    logits = memory_profile.dummy_forward(model, 19, torch.device("cpu"))
    assert logits.shape == (19, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_the_graph_pool_estimate_counts_every_forms_static_outputs(
    tiny_dir, huginn_small_dir, family
):
    """Each bucket's captured step keeps its rows' outputs, and in a form with the leave its
    logits, as static outputs, all alive together in the graphs' pool: `graph_outputs_bytes`
    with a family's forms (Ouro 2, 1 with the leave; Huginn 4, 2) is what they hold."""
    from loopserve.runner.memory_profile import graph_outputs_bytes
    from tests.engine_utils import make_engine

    path = tiny_dir if family == "ouro" else huginn_small_dir
    args = {} if family == "ouro" else {"exit_criterion": "latent-diff", "coda_batching": "off"}
    engine = make_engine(path, graph_mode="emulate", max_num_seqs=6, **args)
    graphs = engine.runner.graphs
    forms = graphs.forms()
    assert len(forms) == (2 if family == "ouro" else 4)
    held = 0
    with torch.inference_mode():
        for bucket in graphs.buckets:  # 1, 2, 4, 6
            for form in forms:
                out, _, _, logits, _, _ = graphs._forward(bucket, *form)
                held += out.numel() * out.element_size()
                if logits is not None:
                    held += logits.numel() * logits.element_size()
    model = engine.model
    num_leave = sum(leaves for _, leaves in forms)
    assert held == graph_outputs_bytes(
        6, state_width=model.state_width, vocab_size=model.config.vocab_size, element=4,
        num_forms=len(forms), num_leave_forms=num_leave,
    )  # fmt: skip
    assert num_leave == (1 if family == "ouro" else 2)
