"""Decode core calls through static, row-bucketed buffers (`graph_mode=emulate` on CPU): the
padded path changes no output and never writes a real request's K/V."""

from __future__ import annotations

import pytest
import torch

from loopserve.config import EngineConfig, effective_graph_mode
from loopserve.contracts import DecodeRow
from loopserve.runner.graph_buffers import bucket_for, graph_buckets
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import decode_rows, make_engine, random_workload, reference_for, run_steps


def test_buckets_are_powers_then_multiples_of_eight_up_to_max_rows():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(3) == (1, 2, 3)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert graph_buckets(30) == (1, 2, 4, 8, 16, 24, 30)
    buckets = graph_buckets(30)
    assert [bucket_for(buckets, n) for n in (1, 3, 5, 9, 17, 25, 30, 31)] == [
        1, 4, 8, 16, 24, 30, 30, None,
    ]  # fmt: skip


def test_graph_mode_resolution():
    def mode(**kwargs):
        return effective_graph_mode(EngineConfig.from_engine_args(**kwargs))

    assert mode() == "off"  # auto on CPU: eager
    assert mode(device="cuda") == "capture"
    assert mode(device="cuda", enforce_eager=True) == "off"
    assert mode(graph_mode="emulate") == "emulate"
    assert mode(graph_mode="emulate", enforce_eager=True) == "off"


def _run(tiny_dir, work, **overrides):
    engine = make_engine(tiny_dir, max_model_len=96, **overrides)
    finished = run_steps(engine, work)
    return engine, {rid: (out.token_ids, out.exit_depths) for rid, out in finished.items()}


@pytest.mark.parametrize(
    ("layout", "mode", "exit_mode", "prefill_mode"),
    [
        ("last_exited", "refill", "ouro", "atomic"),
        ("last_exited", "no_refill", "ouro_delayed", "wavefront"),
        ("shared", "refill", "trace", "atomic"),
        ("last_exited", "refill", "random_lookahead", "per_depth"),
        ("last_exited", "no_refill", "ouro", "mixed"),  # decode + prompt rows: eager calls
    ],
)
def test_emulated_graphs_match_eager_and_reference(tiny_dir, layout, mode, exit_mode, prefill_mode):
    vocab = 256
    work = random_workload(41, 8, vocab, sampled=True)
    args = dict(layout=layout, mode=mode, exit_mode=exit_mode, prefill_mode=prefill_mode)
    if prefill_mode == "mixed":
        args.update(prefill_mode="per_depth", mixed_prefill_decode=True)
    # max_num_seqs 6: buckets 1, 2, 4, 6, so calls of 3 and 5 rows are padded.
    eager, eager_out = _run(tiny_dir, work, max_num_seqs=6, **args)
    graphs, graph_out = _run(tiny_dir, work, max_num_seqs=6, graph_mode="emulate", **args)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    assert graph_out == eager_out
    for request_id, prompt, params, _ in work:
        ref = reference_for(graphs, prompt, params)
        assert graph_out[request_id] == (ref.token_ids, ref.exit_depths), request_id
    # The padded path really ran, and padding happened.
    stats = graphs.stats
    assert stats.num_graph_calls > 0 and stats.num_padded_rows > 0
    assert eager.stats.num_graph_calls == 0
    # Every real KV slot matches the eager run's. Not bitwise: CPU matmuls of fewer than 4
    # rows take another kernel than padded ones, which moves the last float32 bit (about 1e-6
    # here); a padding row writing a real slot would differ by O(1).
    real = eager.runner.kv_cache.shape[2]
    assert graphs.runner.kv_cache.shape[2] == real + eager.config.cache.block_size
    torch.testing.assert_close(
        graphs.runner.kv_cache[:, :, :real], eager.runner.kv_cache, atol=1e-5, rtol=0
    )
    assert graphs.runner.graphs.captured is False  # CPU: emulated, never captured


def test_calls_above_the_largest_bucket_and_prompt_calls_run_eagerly(tiny_dir):
    engine = make_engine(tiny_dir, max_model_len=96, graph_mode="emulate", max_num_seqs=4)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4)
    assert graphs.fits(4, 95) and not graphs.fits(5, 0)
    assert not graphs.fits(1, 96)  # max_model_len 96: positions 0..95 only
    work = random_workload(7, 3, 256, sampled=False)
    seen = []
    run_steps(
        engine,
        work,
        on_step=lambda e: seen.append((e.stats.num_steps, e.stats.num_graph_calls)),
    )
    # Atomic prompt steps run D core calls each, none through the static path: the graph
    # calls are fewer than the core calls.
    stats = engine.stats
    assert 0 < stats.num_graph_calls < stats.num_core_calls


def test_capture_needs_cuda(tiny_dir):
    engine = make_engine(tiny_dir, max_model_len=96, graph_mode="emulate")
    with pytest.raises(RuntimeError, match="CUDA"):
        engine.runner.graphs.capture()


def _rows(*rows: tuple[str, int, int]):
    """Decode rows (request, position, depth) that continue after this loop."""
    return decode_rows(*(DecodeRow(r, pos, d, 5, 0, False, 0.0, 1.0, 1.0) for r, pos, d in rows))


def _planes(plane0: list[int], offset: int) -> tuple[list[int], ...]:
    """A request's four plane tables: `plane0`, the others on blocks `offset` apart."""
    return tuple([b + k * offset for b in plane0] for k in range(4))


def test_padding_rows_write_only_the_dummy_block(tiny_dir):
    engine = make_engine(tiny_dir, max_model_len=96, graph_mode="emulate", max_num_seqs=8)
    runner, graphs = engine.runner, engine.runner.graphs
    kv = runner.kv_cache
    torch.manual_seed(3)
    kv.normal_()  # every slot holds a distinct value, so any stray write shows
    before = kv.clone()
    # 3 real rows (bucket 4: one padding row), loop 0, on blocks 5, 6 and 9 of their plane-0
    # tables of two blocks (their other planes are 40 blocks further on).
    tables = {"a": _planes([2, 5], 40), "b": _planes([7, 6], 40), "c": _planes([1, 9], 40)}
    rows = _rows(("a", 5, 0), ("b", 6, 0), ("c", 4, 0))
    host = runner.decode.host_columns(rows, tables)
    bucket = graphs.stage(rows, host)
    out = graphs.launch(bucket, rows, host).out
    assert out.shape == (3, engine.model.config.hidden_size)
    assert (graphs.num_calls, graphs.num_padded_rows) == (1, 1)
    changed = (kv != before).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist()
    dummy = engine.config.cache.num_blocks * 4
    assert changed == [21, 26, 36, dummy]  # the real rows' slots (block_size 4), then the dummy
    # The static inputs of bucket 4: real tables then the dummy block, one padding row.
    d = engine.config.cache.num_blocks
    width = graphs.max_blocks  # ceil(96 / 4)
    assert width == 24
    expected = [[2, 5] + [d] * 22, [7, 6] + [d] * 22, [1, 9] + [d] * 22, [d] * 24]
    assert graphs.block_tables[graphs.loop_planes.table_index[:4]].tolist() == expected
    assert graphs.loop_planes.table_index[3].item() == graphs.padding_table  # the dummy-only row
    assert graphs.context_lens[:4].tolist() == [6, 7, 5, 1]
    assert graphs.loop_planes.write_slots[:4].tolist() == [21, 26, 36, dummy]
    # A smaller call after it: loop 1 of "c" reads its plane-1 table.
    rows = _rows(("c", 4, 1))
    host = runner.decode.host_columns(rows, tables)
    graphs.launch(graphs.stage(rows, host), rows, host)
    assert graphs.block_tables[graphs.loop_planes.table_index[0], :2].tolist() == [41, 49]


def test_persistent_tables_send_only_the_entries_a_table_gained(tiny_dir):
    """The decode rows' device tables are written incrementally: a call's one copy in carries
    only the entries its rows' tables gained (every plane), besides its per-row columns."""
    engine = make_engine(tiny_dir, max_model_len=96, graph_mode="emulate", max_num_seqs=4)
    runner = engine.runner
    sent = []

    def begin(rows, tables):
        before = runner.transfers.counts()
        runner.decode.begin(_rows(*rows), tables)
        h2d, _, h2d_bytes, _ = (a - b for a, b in zip(runner.transfers.counts(), before))
        assert h2d == 1  # one staged copy per call
        sent.append(h2d_bytes // 8)  # int64 values

    a, b = _planes([10, 11, 12], 40), _planes([20, 21, 22], 40)
    tables = {"a": a, "b": b}
    # Per row: slot, position, table row; the loop-0 rows also their index and token.
    begin([("a", 5, 0), ("b", 6, 0)], tables)  # blocks 0-1 of each plane: 2 x 4 x 2 entries
    begin([("a", 6, 1), ("b", 7, 1)], tables)  # same blocks: no entry
    begin([("a", 8, 0), ("b", 7, 2)], tables)  # "a" enters block 2: one entry per plane
    assert sent == [2 * 5 + 2 * 16, 2 * 3, 2 * 3 + 2 + 2 * 4]
    slots = runner.decode_slots
    a_row = slots.slot_of["a"] * 4
    assert slots.tables[a_row + 3, :3].tolist() == a[3]
    # A request released and back (a preemption gave "b" new blocks) is written again.
    runner.decode_slots.release("b")
    begin([("b", 6, 0)], {"b": _planes([30, 31], 50)})
    assert sent[-1] == 5 + 2 * 8
    b_row = slots.slot_of["b"] * 4
    assert slots.tables[b_row + 1, :2].tolist() == [80, 81]


def test_failed_capture_falls_back_to_eager_and_says_why(tiny_model):
    from loopserve.runner.model_runner import ModelRunner
    from loopserve.runner.options import RunnerOptions

    # Capture on CPU raises; the runner keeps serving eagerly and records the error.
    options = RunnerOptions(num_blocks=8, block_size=4, graph_mode="capture", max_model_len=32,
                            max_num_seqs=2)  # fmt: skip
    runner = ModelRunner(tiny_model, options)
    assert runner.graphs is None
    assert runner.graph_capture_error is not None and "CUDA" in runner.graph_capture_error


def test_a_long_table_beyond_the_buffers_entries_is_written_apart_and_decodes_exactly(tiny_dir):
    """A request whose first decode row brings a table longer than the bucket buffer's entry
    region (bucket 1 holds 2 * 1 * 4 + 64 = 72 entries: 18 blocks on each of 4 planes) writes
    the rest with one extra copy before the launch; the tokens still equal the reference."""
    engine = make_engine(
        tiny_dir, graph_mode="emulate", max_num_seqs=1, max_num_batched_tokens=48,
        max_model_len=256, num_blocks=1024,
    )  # fmt: skip
    copies = []
    engine.core.add_observer(
        lambda s, o: copies.append(o.stats.num_h2d_transfers) if o.stats.num_graph_calls else None
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, exit_threshold=0.5)
    prompt = [(7 * j + 3) % 200 + 1 for j in range(100)]  # 25 blocks of 4 per plane
    finished = run_steps(engine, [("long", prompt, params, 0)])
    ref = reference_for(engine, prompt, params)
    assert (finished["long"].token_ids, finished["long"].exit_depths) == (
        ref.token_ids, ref.exit_depths,
    )  # fmt: skip
    assert copies and copies[0] == 2 and all(c == 1 for c in copies[1:])  # the overflow, once


def test_decode_tables_keep_each_slots_once_planes_in_its_own_rows():
    """A family with once planes (Huginn: its prelude and coda K/V after the loop planes)
    sends block tables with one more plane than its loop planes: each slot keeps that plane
    in a row of its own (row stride = loop + once planes), never in the next slot's rows."""
    import numpy as np

    from loopserve.runner.decode_slots import DecodeSlots

    slots = DecodeSlots(2, hidden_size=4, num_planes=2, block_size=4, max_blocks=3,
                        padding_block=0, dtype=torch.float32, device=torch.device("cpu"),
                        once_planes=1)  # fmt: skip
    tables = {"a": ([1, 2], [3, 4], [5, 6]), "b": ([7, 8], [9, 10], [11, 12])}
    index, values = slots.table_updates(np.array([0, 1]), np.array([5, 5]), ["a", "b"], tables)
    flat = slots.tables.view(-1)
    flat[torch.tensor(index)] = torch.tensor(values)
    assert slots.stride == 3 and slots.padding_row == 6
    rows = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert slots.tables[:6, :2].tolist() == rows


def test_merged_projections_decode_like_the_dense_reference(tiny_dir):
    """The model as the loader prepares it on CUDA (q/k/v and gate/up merged) through the
    emulated decode graphs: the same tokens and exits as the dense reference of that model."""
    vocab = 256
    work = random_workload(43, 6, vocab, sampled=True)
    engine = make_engine(tiny_dir, max_num_seqs=6, graph_mode="emulate")
    engine.model.merge_projections()
    assert engine.model.model.layers[0].self_attn.qkv_weight is not None
    finished = run_steps(engine, work)
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert engine.stats.num_graph_calls > 0


def test_a_graphed_step_packs_its_exit_signals_itself(tiny_dir):
    """The gate's exits and hazards leave a graphed call already packed as float64 (inside
    the step, `DecodeSignals.packed`), with every row's greedy token when the call has coda
    candidates: outside the replay the host converts nothing (no exit flag, no hazard, no
    token id) and reads them all in one copy."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    class Conversions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sources = []  # dtypes converted to float64 outside the replay

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy):
                dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
                if dtype is torch.float64:
                    self.sources.append(args[0].dtype)
            return func(*args, **kwargs)

    engine = make_engine(tiny_dir, max_model_len=96, graph_mode="emulate", exit_mode="ouro")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    for i in range(3):
        engine.add_request(f"g{i}", [5 + i, 9, 11], params)
    graphs = engine.runner.graphs
    launch, replays = graphs.launch, []

    def replay(*args):  # the emulated device: its own conversions are not the host's
        with _disable_current_modes():
            out = launch(*args)
        replays.append(out)
        return out

    graphs.launch = replay
    reads = []
    while engine.has_unfinished_requests():
        before = len(replays)
        d2h = engine.runner.transfers.num_d2h
        with Conversions() as seen:
            engine.step()
        if len(replays) == before:  # a prompt step: eager calls
            continue
        assert not seen.sources, seen.sources
        reads.append(engine.runner.transfers.num_d2h - d2h)
    assert replays and all(out.packed is not None for out in replays)
    with_tokens = [out for out in replays if len(out.candidates)]
    assert with_tokens and all(out.greedy and len(out.packed) == 3 for out in with_tokens)
    assert set(reads) == {1}


@pytest.mark.parametrize("sampled", [False, True])
def test_ouros_graphed_call_runs_its_lm_head_with_candidates_and_hands_back_their_argmax(
    tiny_dir, monkeypatch, sampled
):
    """Ouro's graphed step runs its leave (the lm_head over every row) only in calls with
    coda candidates (each bucket is captured with and without it), and packs every row's
    argmax with the signals: a call whose candidates all take the argmax samples nothing on
    the host side (no sampling pass, no lm_head outside the step); one with a sampled
    candidate samples from the step's logits. Tokens and exits stay the reference's."""
    import loopserve.runner.coda as coda_module

    engine = make_engine(tiny_dir, graph_mode="emulate", max_num_seqs=6)
    graphs = engine.runner.graphs
    assert graphs.forms() == ((True, False), (True, True))
    leaves, sampling = [0], [0]
    leave = graphs.leave

    def counted_leave(*args, **kwargs):
        leaves[0] += 1
        return leave(*args, **kwargs)

    sample = coda_module.sample_on_device

    def counted_sample(*args, **kwargs):
        sampling[0] += 1
        return sample(*args, **kwargs)

    graphs.leave = counted_leave
    monkeypatch.setattr(coda_module, "sample_on_device", counted_sample)
    model_leave, outside = engine.runner.calls.leave, [0]

    def counted_model_leave(*args, **kwargs):
        outside[0] += 1
        return model_leave(*args, **kwargs)

    engine.runner.calls.leave = counted_model_leave
    engine.runner.coda.coda = counted_model_leave
    launch, calls = graphs.launch, []

    def watched(bucket, rows, host):
        before = leaves[0]
        out = launch(bucket, rows, host)
        calls.append([len(host.candidates) > 0, leaves[0] - before, None, None])
        return out

    graphs.launch = watched

    def observe(scheduled, output):
        if output.stats.num_graph_calls:
            calls[-1][2:] = [sampling[0], outside[0]]
        sampling[0] = outside[0] = 0

    engine.core.add_observer(observe)
    work = random_workload(47, 8, 256, sampled=sampled)
    finished = run_steps(engine, work)
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert {candidates for candidates, *_ in calls} == {True, False}
    assert all(ran == int(candidates) for candidates, ran, _, _ in calls), calls
    assert all(outside == 0 for *_, outside in calls)  # no lm_head outside the step
    with_candidates = [samples for candidates, _, samples, _ in calls if candidates]
    if sampled:  # some call samples a candidate from the step's logits
        assert max(with_candidates) == 1
    else:
        assert set(with_candidates) == {0}


def test_graphed_candidates_asking_for_logprobs_sample_from_the_steps_logits(tiny_dir):
    """A candidate that asks for log-probabilities does not take the packed argmax: it is
    sampled from the graphed step's logits of its row, and its tokens, exits and
    log-probabilities equal an eager engine's (float32; the lm_head over the bucket's rows
    against the eager one over the candidates' rounds alike to 1e-5)."""
    work = [
        (f"q{i}", [3 + i, 17, 40 + i], SamplingParams(
            max_tokens=6, temperature=0.0, exit_threshold=0.5, ignore_eos=True,
            logprobs=3 if i % 2 else None), i)
        for i in range(4)
    ]  # fmt: skip
    outs = {}
    for mode in ("off", "emulate"):
        engine = make_engine(tiny_dir, graph_mode=mode, max_num_seqs=4)
        outs[mode] = run_steps(engine, work)
        assert (engine.stats.num_graph_calls > 0) == (mode == "emulate")
    for request_id, _, params, _ in work:
        eager, graphed = outs["off"][request_id], outs["emulate"][request_id]
        assert (graphed.token_ids, graphed.exit_depths) == (eager.token_ids, eager.exit_depths)
        if params.logprobs is None:
            assert graphed.logprobs is None
            continue
        assert len(graphed.logprobs) == len(eager.logprobs) == 6
        for g, e in zip(graphed.logprobs, eager.logprobs):
            assert [t for t, _ in g.top_logprobs] == [t for t, _ in e.top_logprobs]
            assert g.logprob == pytest.approx(e.logprob, abs=1e-5)


def test_a_capture_says_how_many_graphs_it_recorded(tiny_dir, monkeypatch, caplog):
    """Start-up logs what the capture recorded: every bucket in every form of the step (Ouro:
    with and without its leave), and how long it took (capture itself needs CUDA; here it
    records placeholders)."""
    import dataclasses
    import logging

    from loopserve.runner.graphs import DecodeGraphs

    def fake_capture(self):
        for bucket in self.buckets:
            for form in self.forms():
                self.graphs[(bucket, *form)] = object()

    monkeypatch.setattr(DecodeGraphs, "capture", fake_capture)
    engine = make_engine(tiny_dir, graph_mode="emulate", max_num_seqs=6)
    runner = engine.runner
    runner.options = dataclasses.replace(runner.options, graph_mode="capture")
    with caplog.at_level(logging.INFO, logger="loopserve.runner.graphs"):
        graphs, error = runner._graphs()
    assert error is None and len(graphs.graphs) == 8
    assert "captured 8 decode graphs (4 row buckets up to 6 rows x 2 forms) in" in caplog.text
