"""Host <-> device copies of the step path: counted, packed, and made only through
`runner.transfers.Transfers` (counts are logical, so they hold on CPU as on a GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from loopserve.exit.columns import GATE
from loopserve.runner.transfers import Transfers
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, reference_for, run_steps

RUNNER = Path(__file__).resolve().parents[1] / "loopserve" / "runner"
STEP_PATH = (
    "model_runner.py", "graphs.py", "graph_buffers.py", "sampler.py", "logits_adjust.py", "decode_rows.py",
    "coda.py", "decode_reads.py", "attention/triton_backend.py", "eager_step.py",
)  # fmt: skip
# What synchronises with the device or copies outside the helper.
FORBIDDEN = re.compile(r"\.item\(\)|\.tolist\(\)|\.cpu\(\)|torch\.tensor\(|\.synchronize\(")
# A line that converts a host (numpy) array says so in its comment: "# host array".
HOST_ARRAY = "# host array"


def _code_lines(path: Path) -> list[tuple[int, str]]:
    lines, in_doc = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.count('"""') == 1:
            in_doc = not in_doc
            continue
        if in_doc or stripped.startswith("#") or stripped.startswith('"""'):
            continue
        if HOST_ARRAY in line:
            continue
        lines.append((number, line.split("#")[0]))
    return lines


def test_the_step_path_copies_only_through_the_transfer_helper():
    found = [
        f"{name}:{number}: {line.strip()}"
        for name in STEP_PATH
        for number, line in _code_lines(RUNNER / name)
        if FORBIDDEN.search(line) and "def capture" not in line
    ]
    # Graph capture synchronises once at start-up, never in a step.
    allowed = [
        f for f in found if f.startswith("graphs.py") and "cuda.synchronize(self.device)" in f
    ]
    assert [f for f in found if f not in allowed] == []
    assert len(allowed) == 1


def test_the_static_check_finds_a_forbidden_copy(tmp_path):
    """Control: the same scan flags the patterns it looks for."""
    source = tmp_path / "x.py"
    source.write_text(
        '"""doc .tolist()"""\nx = y.tolist()  # a sync\n# z.item()\nw = torch.tensor([1])\n'
        "v = rows.tolist()  # host array\n"
    )
    hits = [n for n, line in _code_lines(source) if FORBIDDEN.search(line)]
    assert hits == [2, 4]


def _decode_steps(engine, work):
    """(D2H, H2D, gate decided) copies of every decode-only step (one core call, decode rows
    only); "gate decided": some row's exit was this loop's gate's to decide, or a batch of
    held tokens' leaves ran (coda batching in time: its sampled tokens are read with the
    step's one copy out). Such a batch's own copy in (its slots, positions and which loop-0
    rows take its tokens) is counted apart."""
    per_step = []

    def watch(scheduled, output):
        if scheduled.decode is not None and not scheduled.items:
            leave = scheduled.leave is not None
            gated = bool((scheduled.decode.exit_code == GATE).any()) or leave
            stats = output.stats
            per_step.append((stats.num_d2h_transfers, stats.num_h2d_transfers - leave, gated))

    engine.core.add_observer(watch)
    finished = run_steps(engine, work)
    return finished, per_step


def _work(threshold: float, logprobs: int | None = None, *, greedy_only: bool = False):
    work = []
    for i, length in enumerate([3, 8, 13, 5]):
        temperature = 0.0 if greedy_only or i % 2 else 0.9
        params = SamplingParams(
            max_tokens=7, temperature=temperature, seed=50 + i, ignore_eos=True,
            exit_threshold=threshold, exit_trace=(2, 3, 4, 1), logprobs=logprobs,
        )  # fmt: skip
        work.append((f"t{i}", [(11 * i + 5 * j + 1) % 256 for j in range(length)], params, 0))
    return work


def _assert_reference(engine, work, finished) -> None:
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        assert (finished[request_id].token_ids, finished[request_id].exit_depths) == (
            ref.token_ids, ref.exit_depths,
        ), request_id  # fmt: skip


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
@pytest.mark.parametrize("exit_mode", ["trace", "ouro_delayed"])
def test_a_decode_call_whose_exits_are_known_ahead_copies_once_each_way(
    tiny_dir, exit_mode, graph_mode
):
    """Exits known before the call (trace, ouro_delayed): the call's inputs go in as one
    staged copy (slots, positions, table rows, new tokens, new table entries), and hazards,
    sampled ids and log-probabilities come back in one packed copy."""
    engine = make_engine(tiny_dir, exit_mode=exit_mode, graph_mode=graph_mode)
    work = _work(0.5, logprobs=2)
    finished, per_step = _decode_steps(engine, work)
    _assert_reference(engine, work, finished)
    assert len(per_step) > 5
    assert all(h2d == 1 for _, h2d, _ in per_step), per_step
    assert all(d2h <= 1 for d2h, _, _ in per_step), per_step
    assert any(d2h == 1 for d2h, _, _ in per_step)  # a call that sampled read once
    assert engine.stats.num_d2h_transfers > 0 and engine.stats.d2h_bytes > 0
    if graph_mode == "emulate":
        assert engine.stats.num_graph_calls > 0


def test_a_gate_decided_call_of_greedy_rows_reads_the_device_once(tiny_dir):
    """`ouro`, every request greedy: this loop's gate decides exits on the device, every
    candidate row is sampled at once (argmax advances no generator), and exit flags, hazards
    and tokens come back in one copy; rows that did not exit drop their token."""
    engine = make_engine(tiny_dir, exit_mode="ouro", graph_mode="emulate")
    work = _work(0.4, greedy_only=True)
    finished, per_step = _decode_steps(engine, work)
    _assert_reference(engine, work, finished)
    gated = [d2h for d2h, _, decided in per_step if decided]
    assert len(gated) > 3  # the gate really decided in these calls
    assert all(d2h == 1 for d2h, _, _ in per_step), per_step
    assert all(h2d == 1 for _, h2d, _ in per_step), per_step


def test_a_gate_decided_call_with_a_sampled_row_reads_exits_then_tokens(tiny_dir):
    """`ouro` with a sampled (seeded) request among the candidates: sampling it before its
    exit is known would advance its generator, so the exits are read first and only the rows
    that exit are sampled: two copies out."""
    engine = make_engine(tiny_dir, exit_mode="ouro")
    work = _work(0.4)
    finished, per_step = _decode_steps(engine, work)
    _assert_reference(engine, work, finished)
    assert per_step and all(d2h <= 2 for d2h, _, _ in per_step)
    assert any(d2h == 2 for d2h, _, _ in per_step)
    assert all(h2d == 1 for _, h2d, _ in per_step), per_step


def test_deferred_reads_ride_along_with_the_next_copy():
    transfers = Transfers(torch.device("cpu"))
    received = []
    transfers.defer(torch.tensor([0.25, 0.5]), received.append)
    transfers.defer(torch.tensor([[1.0], [2.0]]), received.append)
    assert transfers.to_host(torch.tensor([7, 8])) == [7.0, 8.0]
    assert received == [[0.25, 0.5], [1.0, 2.0]]
    assert transfers.num_d2h == 1
    transfers.flush()  # nothing deferred: no copy
    assert transfers.num_d2h == 1


def test_an_eager_triton_call_sends_its_attention_metadata_in_one_copy(monkeypatch):
    """The Triton backend's per-call metadata (write slots, tables, decode rows, prompt tiles)
    goes to the device through the runner's counter, in one staged copy."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from loopserve.runner.attention.base import RowSegment
    from loopserve.runner.attention.triton_backend import TritonBackend

    transfers = Transfers(torch.device("cpu"))
    kv = torch.zeros(2, 2, 64 * 4, 2, 16)
    backend = TritonBackend(kv, block_size=4, scale=1.0, transfers=transfers)
    segments = [RowSegment([3, 5], 6, 1), RowSegment([7, 8, 9], 0, 11), RowSegment([1], 2, 1)]
    attn = backend.prepare(segments)
    assert transfers.num_h2d == 1
    meta = attn.meta
    assert meta.write_slots.tolist() == [5 * 4 + 2, *range(28, 32), *range(32, 36), 36, 37, 38, 6]
    assert meta.decode_rows.tolist() == [0, 12] and meta.decode_seq_lens.tolist() == [7, 3]
    assert meta.tables.tolist() == [[3, 5, 0], [7, 8, 9], [1, 0, 0]]


@pytest.mark.parametrize("criterion", ["latent-diff", "kl"])
def test_a_huginn_decode_call_copies_once_each_way(tmp_path, criterion):
    """The same decode path serves Huginn (the one executor): per decode-only call one staged
    copy in (with the rows the criterion checks and their thresholds) and, every request
    greedy, one packed copy out (exit flags, criterion scores, tokens), whether the criterion
    reads latents or the coda's logits (kl: the coda runs on the device for the checked rows,
    its positions taken from the staged copy)."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

    model_dir = make_tiny_huginn_checkpoint(tmp_path / "huginn")
    engine = make_engine(model_dir, exit_criterion=criterion)
    work = []
    for i, length in enumerate([3, 8, 13, 5]):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                exit_threshold=(0.2, 1.0, 0.05, 0.1)[i], min_loops=2)  # fmt: skip
        work.append((f"h{i}", [(11 * i + 5 * j + 1) % 128 for j in range(length)], params, i))
    finished, per_step = _decode_steps(engine, work)
    assert all(not finished[rid].error for rid, *_ in work)
    assert len(per_step) > 10 and any(decided for _, _, decided in per_step)
    assert all(h2d == 1 for _, h2d, _ in per_step), per_step
    assert all(d2h <= 1 for d2h, _, _ in per_step), per_step
    assert all(d2h == 1 for d2h, _, decided in per_step if decided), per_step
