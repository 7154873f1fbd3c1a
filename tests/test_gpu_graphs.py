"""GPU checks of the CUDA-graph decode path, async scheduling and the CUDA memory plan.

Marked `gpu` (skipped by the default `-m 'not gpu'`; run with `pytest -m gpu`). float32, so
graphs and eager must agree on every token and exit depth."""

from __future__ import annotations

import pytest
import torch

from tests.engine_utils import make_engine, random_workload, reference_for, run_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _outputs(finished):
    return {rid: (out.token_ids, out.exit_depths) for rid, out in finished.items()}


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("exit_mode", ["ouro", "ouro_delayed"])
def test_cuda_graphs_match_eager_fp32(tiny_dir, layout, exit_mode):
    work = random_workload(11, 10, 256, sampled=True)
    args = dict(device="cuda", layout=layout, exit_mode=exit_mode, max_num_seqs=6, max_model_len=96)
    eager = make_engine(tiny_dir, enforce_eager=True, **args)
    graphs = make_engine(tiny_dir, **args)  # graph_mode auto: captured on CUDA
    assert eager.runner.graphs is None
    assert graphs.runner.graph_capture_error is None
    assert graphs.runner.graphs is not None and graphs.runner.graphs.captured
    # Every bucket in both forms of Ouro's step: with its leave (calls with coda
    # candidates) and without.
    forms = [(b, True, leaves) for b in (1, 2, 4, 6) for leaves in (False, True)]
    assert sorted(graphs.runner.graphs.graphs) == forms
    eager_out = _outputs(run_steps(eager, work))
    graph_out = _outputs(run_steps(graphs, work))
    assert graph_out == eager_out
    for request_id, prompt, params, _ in work:
        ref = reference_for(graphs, prompt, params)
        assert graph_out[request_id] == (ref.token_ids, ref.exit_depths), request_id
    assert graphs.stats.num_graph_calls > 0 and graphs.stats.num_padded_rows > 0
    real = eager.runner.kv_cache.shape[2]
    torch.testing.assert_close(
        graphs.runner.kv_cache[:, :, :real], eager.runner.kv_cache, atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("exit_mode", ["ouro_delayed", "trace"])
def test_async_matches_sync_on_cuda(tiny_dir, exit_mode):
    work = random_workload(12, 10, 256, sampled=True)
    args = dict(device="cuda", exit_mode=exit_mode, max_model_len=96)
    sync_out = _outputs(run_steps(make_engine(tiny_dir, **args), work))
    engine = make_engine(tiny_dir, async_scheduling=True, **args)
    assert _outputs(run_steps(engine, work)) == sync_out
    assert engine.stats.num_steps_scheduled_ahead > 0
    engine.core.shutdown()


def test_cuda_memory_plan_sizes_kv_from_the_profile(tiny_dir):
    engine = make_engine(tiny_dir, device="cuda", num_blocks=None, gpu_memory_utilization=0.2)
    blocks = engine.config.cache.num_blocks
    assert blocks is not None and blocks > 0
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()
    assert kv_bytes <= 0.2 * total


@pytest.mark.parametrize("criterion", ["kl", "latent-diff"])
def test_huginn_cuda_graphs_match_eager_fp32(tmp_path, criterion):
    """Huginn's decode step captured (prelude and coda over the once planes, the criterion
    inside the graph) gives eager's tokens and steps on CUDA, with one copy each way per
    graphed call (the emulated step's CPU tests: tests/test_huginn_engine.py)."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from tests.test_huginn_engine import workload

    model = make_tiny_huginn_checkpoint(tmp_path / "huginn")
    work = workload(71, criterion, count=6)
    args = dict(device="cuda", exit_criterion=criterion, max_num_seqs=6, max_model_len=96)
    eager = make_engine(model, graph_mode="off", **args)
    graphs = make_engine(model, graph_mode="capture", **args)
    assert graphs.runner.graph_capture_error is None
    assert graphs.runner.graphs is not None and graphs.runner.graphs.captured
    assert _outputs(run_steps(graphs, work)) == _outputs(run_steps(eager, work))
    assert graphs.stats.num_graph_calls > 0
