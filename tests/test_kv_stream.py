"""Streamed prefill/decode hand-off between two in-process engines (engine/kv_stream.py): the
decode engine reserves blocks first, prompt blocks travel as `KVChunk`s plane by plane as soon
as they are final (plane d after depth d), the final hand-off carries the rest. Tokens and exit
depths equal the dense references over every prompt arm, both layouts and both families, with
prefix hits on the decode side (not sent) and preemption on either side; chunks arrive while
later chunks still run (counted); a sender that dies leaves no block behind."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loopserve.errors import InvalidRequestError
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import assert_match_reference, make_engine, reference_for, run_steps
from tests.test_huginn_engine import assert_matches_reference
from tests.test_preemption import PROMPT_ARMS, assert_all_released

SHARED = [5, 9, 13, 2, 7, 11, 3, 8, 21, 4, 6, 30]  # three blocks of 4


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


class StreamLog:
    """What moved per request: chunks as (first block, blocks, planes), blocks written in
    every plane on the decode side before the prefill engine's step that completed the
    request's prompt, the final hand-off's first block, and the reservation's cached blocks."""

    def __init__(self, num_planes: int) -> None:
        self.num_planes = num_planes
        self.chunks: dict[str, list[tuple[int, int, tuple[int, ...]]]] = {}
        self.before_last_chunk: dict[str, list[int]] = {}  # per plane
        self.final_first_block: dict[str, int] = {}
        self.skipped: dict[str, int] = {}

    def add(self, chunk) -> None:
        planes = tuple(range(self.num_planes)) if chunk.planes is None else chunk.planes
        self.chunks.setdefault(chunk.request_id, []).append(
            (chunk.first_block, chunk.num_blocks, planes)
        )

    def of_plane(self, request_id: str, plane: int) -> list[tuple[int, int]]:
        """(first block, blocks) of the request's chunks that carried `plane`, in order."""
        return [(f, n) for f, n, planes in self.chunks.get(request_id, []) if plane in planes]

    def received_by_plane(self, request_id: str) -> list[int]:
        return [self.received(request_id, p) for p in range(self.num_planes)]

    def received(self, request_id: str, plane: int | None = None) -> int:
        """Blocks received in `plane` (None: in every plane)."""
        planes = range(self.num_planes) if plane is None else [plane]
        return min(sum(n for _, n in self.of_plane(request_id, p)) for p in planes)


def run_streamed(
    prefill,
    decode,
    work,
    *,
    on_prefill_step=None,
    on_chunk=None,
    streamed_only=True,
    sender_skips=None,
    on_export=None,
):
    """Every request is reserved on `decode`, prefilled on `prefill` with its K/V streamed
    chunk by chunk, handed off after its first token and decoded on `decode`; both engines
    step in turn. A request that finishes with its first token releases its reservation;
    one the decode pool has no room to reserve for (`streamed_only=False`) moves whole.
    `sender_skips`: the blocks the prefill engine skips instead of those the reservation
    reports (chunks cut for another replica's cache). Returns (final outputs, `StreamLog`)."""
    log = StreamLog(prefill.kv.num_planes)
    for request_id, prompt, params, _ in work:
        skip = decode.reserve_import(request_id, prompt, params)
        prefill.add_request(request_id, prompt, params)
        if skip is None:  # no room on the decode side now: the hand-off moves whole
            assert not streamed_only, "the decode pool is sized for every reservation"
            continue
        log.skipped[request_id] = skip
        prefill.stream_export(request_id, skip if sender_skips is None else sender_skips)
    finished: dict = {}
    step = 0
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        if prefill.has_unfinished_requests():
            in_prompt = {r for r, q in prefill.scheduler.requests.items() if q.in_prompt_phase}
            before = {r: log.received_by_plane(r) for r in in_prompt}
            for output in prefill.step():
                if output.finished:
                    finished[output.request_id] = output
                    streamed = output.request_id in log.skipped
                    assert decode.release_import(output.request_id) == streamed
            for request_id in in_prompt:
                request = prefill.scheduler.requests.get(request_id)
                if request is None or not request.in_prompt_phase:
                    log.before_last_chunk[request_id] = before[request_id]
            if on_prefill_step is not None:
                on_prefill_step(step)
            for chunk in prefill.take_kv_chunks():
                if on_chunk is not None:
                    on_chunk(chunk)
                decode.write_kv_chunk(chunk)
                log.add(chunk)
            for request_id in list(prefill.scheduler.requests):
                if prefill.can_export(request_id):
                    state = prefill.export_request(request_id)
                    if on_export is not None:
                        on_export(state)
                    log.final_first_block[request_id] = state.first_block
                    decode.import_request(state)
            prefill.scheduler.check_invariants()
        if decode.has_unfinished_requests():
            for output in decode.step():
                if output.finished:
                    finished[output.request_id] = output
            decode.scheduler.check_invariants()
        step += 1
    return finished, log


def workload(seed: int, vocab: int, count: int = 6, *, shared_every: int = 0):
    rng = random.Random(seed)
    work = []
    for i in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([3, 9, 17, 30, 41]))]
        if shared_every and i % shared_every == 0:
            prompt = SHARED + prompt
        params = SamplingParams(
            max_tokens=rng.randrange(1, 10),
            temperature=0.0 if i % 2 == 0 else rng.choice([0.7, 1.0]),
            seed=4000 + i,
            exit_threshold=rng.choice([0.3, 0.6, 0.9]),
            min_loops=rng.choice([1, 1, 2]),
            ignore_eos=True,
        )
        work.append((f"r{i}", prompt, params, 0))
    return work


def assert_streams_consistent(log: StreamLog, work, finished, block_size: int) -> None:
    """In each plane, a request's chunks are contiguous from its skipped blocks on (a
    preempted request's start there again), and the final hand-off starts where the
    shortest plane's end."""
    for request_id, prompt, _, _ in work:
        if request_id not in log.final_first_block:
            assert finished[request_id].num_output_tokens == 1
            continue
        if request_id not in log.skipped:  # moved whole
            assert log.final_first_block[request_id] == 0 and request_id not in log.chunks
            continue
        ends = []
        for plane in range(log.num_planes):
            start = log.skipped[request_id]
            for first, count in log.of_plane(request_id, plane):
                # Contiguous, or (after a recompute preemption) again from the skipped blocks.
                assert first in (start, log.skipped[request_id]) and count > 0, request_id
                start = first + count
            ends.append(start)
        assert log.final_first_block[request_id] == min(ends), request_id
        assert max(ends) <= len(prompt) // block_size


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("arm", sorted(PROMPT_ARMS))
def test_streamed_ouro_equals_reference(tiny_dir, arm, layout):
    if layout == "shared" and arm in ("wavefront", "mixed"):
        pytest.skip("wavefront and mixed batching need the last_exited layout")
    args = dict(layout=layout, prefill_chunk_size=10, **PROMPT_ARMS[arm])
    prefill = make_engine(tiny_dir, **args)
    decode = make_engine(tiny_dir, num_blocks=300, **args)
    work = workload(21, prefill.model.config.vocab_size)
    finished, log = run_streamed(prefill, decode, work)
    assert_match_reference(prefill, work, finished)
    assert_streams_consistent(log, work, finished, prefill.kv.block_size)
    assert sum(log.received(r) for r, *_ in work) > 0  # blocks did move as chunks
    for engine in (prefill, decode):
        assert not engine.has_unfinished_requests()
        assert_all_released(engine)
        assert engine.scheduler.admission.reserved == {}


@pytest.mark.parametrize("arm", ["atomic", "per_depth", "wavefront"])
def test_chunks_arrive_before_the_last_chunk_runs(tiny_dir, arm):
    """A prompt of n chunks (chunk = 3 blocks): the blocks of its first n - 1 chunks are
    written on the decode side before the prefill engine's step that completes its last
    chunk, and under the per-depth arms also the last chunk's blocks of every plane but the
    deepest; only the rest and the first token's follow."""
    args = dict(prefill_chunk_size=12, max_num_batched_tokens=12, **PROMPT_ARMS[arm])
    prefill = make_engine(tiny_dir, **args)
    decode = make_engine(tiny_dir, **args)
    n = 5
    prompt = [(7 * i + 3) % prefill.model.config.vocab_size for i in range(12 * n - 2)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    finished, log = run_streamed(prefill, decode, [("long", prompt, params, 0)])
    before = log.before_last_chunk["long"]
    assert min(before) >= (n - 1) * 3
    assert log.final_first_block["long"] == len(prompt) // 4  # only the partial block is left
    assert_match_reference(prefill, [("long", prompt, params, 0)], finished)
    # Plane d is final once a position ran depth d: where the last chunk runs its depths in
    # separate steps, all its shallow planes left before the step of its last depth.
    deepest = log.num_planes - 1
    if arm == "atomic":
        assert before == [(n - 1) * 3] * log.num_planes
    else:
        assert before[:deepest] == [len(prompt) // 4] * deepest and before[deepest] < before[0]


def test_chunk_writes_are_what_decode_reads(tiny_dir):
    """Zeroing the streamed chunks (not the final hand-off) changes the continuation: the
    decode engine reads the blocks the chunks wrote."""
    prompt = list(range(5, 35))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    work = [("x", prompt, params, 0)]
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    finished, log = run_streamed(prefill, decode, work, on_chunk=lambda c: c.kv.zero_())
    assert log.received("x") > 0
    expected = run_steps(make_engine(tiny_dir), work)["x"]
    out = finished["x"]
    assert out.token_ids[0] == expected.token_ids[0]  # sampled on the prefill side
    assert (out.token_ids, out.exit_depths) != (expected.token_ids, expected.exit_depths)


def test_decode_prefix_hits_are_not_sent(tiny_dir):
    """Pages the decode engine caches already serve the first blocks: the reservation says
    how many, no chunk carries them, and tokens still equal the reference."""
    args = dict(enable_prefix_caching=True)
    prefill = make_engine(tiny_dir, **args)
    decode = make_engine(tiny_dir, **args)
    vocab = prefill.model.config.vocab_size
    warm = [("warm", SHARED + [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0), 0)]
    run_steps(decode, warm)  # the decode engine caches SHARED's three blocks
    work = workload(33, vocab, shared_every=2)
    finished, log = run_streamed(prefill, decode, work)
    assert_match_reference(prefill, work, finished)
    assert_streams_consistent(log, work, finished, 4)
    for request_id, prompt, _, _ in work:
        expected_skip = 3 if prompt[: len(SHARED)] == SHARED else 0
        assert log.skipped[request_id] == expected_skip, request_id
        for first, *_ in log.chunks.get(request_id, []):
            assert first >= expected_skip
    for engine in (prefill, decode):
        assert_all_released(engine)


def test_chunks_cut_for_another_cache_leave_cached_blocks_alone(tiny_dir):
    """The prefill engine streams every block (cut for a replica that cached nothing, as
    when a hand-off is replayed to another decode replica), but this decode engine's prefix
    cache holds the first three: chunk writes and the final hand-off skip those blocks (the
    pages other requests share stay as they are) and tokens equal the reference."""
    args = dict(enable_prefix_caching=True)
    prefill = make_engine(tiny_dir, **args)
    decode = make_engine(tiny_dir, **args)
    warm = [("warm", SHARED + [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0), 0)]
    run_steps(decode, warm)
    work = workload(35, prefill.model.config.vocab_size, shared_every=1)
    short = ("short", SHARED + [4], SamplingParams(max_tokens=5, temperature=0.0), 0)
    work.append(short)  # its final hand-off starts inside the cached blocks
    finished, log = run_streamed(prefill, decode, work, sender_skips=0)
    assert all(log.skipped[r] == 3 for r, *_ in work)
    assert any(first == 0 for r, *_ in work for first, *_ in log.chunks.get(r, []))
    assert log.final_first_block["short"] == 3 and len(short[1]) // 4 == 3
    assert_match_reference(prefill, work, finished)
    for engine in (prefill, decode):
        assert_all_released(engine)
    # Zeroed chunks and final hand-offs: the cached pages' bytes stay as they were.
    pages = decode.kv.match_prefix("probe", SHARED + [0])
    decode.kv.forget("probe")
    index = torch.tensor([b for page in pages for b in page.blocks])
    blocks = decode.runner.moves.swap._blocks(decode.runner.moves.kv_cache)
    before = blocks[:, :, index].clone()
    zero = lambda item: item.kv.zero_()  # noqa: E731
    again = [(f"z{r}", p, q, a) for r, p, q, a in work]
    run_streamed(prefill, decode, again, sender_skips=0, on_chunk=zero, on_export=zero)
    assert len(pages) == 3 and torch.equal(blocks[:, :, index], before)
    # A final hand-off that starts inside the cached blocks (the sender exported before
    # taking its last chunks) leaves them alone too.
    prompt, params = SHARED + [9, 9, 9, 9, 9], SamplingParams(max_tokens=3, temperature=0.0)
    assert decode.reserve_import("late", prompt, params) == 3
    prefill = make_engine(tiny_dir, prefill_chunk_size=4)  # a chunk per block
    prefill.add_request("late", prompt, params)
    prefill.stream_export("late", 0)
    while not prefill.can_export("late"):
        prefill.step()
        if not log.chunks.get("late"):
            for chunk in prefill.take_kv_chunks():
                log.add(chunk)
                zero(chunk)
                decode.write_kv_chunk(chunk)
    state = prefill.export_request("late")
    assert state.first_block < 3
    zero(state)
    decode.import_request(state)
    while decode.has_unfinished_requests():
        decode.step()
    assert torch.equal(blocks[:, :, index], before)
    assert_all_released(decode)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_on_both_sides(tiny_dir, preemption):
    """The prefill engine preempts a streamed request mid-prompt (it sends its blocks again
    from the start) and the decode engine's small pool preempts imported requests: tokens
    equal the reference and nothing leaks."""
    args = dict(preemption_mode=preemption, prefill_chunk_size=8)
    prefill = make_engine(tiny_dir, **args)
    decode = make_engine(tiny_dir, num_blocks=4 * 36, **args)
    work = workload(47, prefill.model.config.vocab_size, count=6)
    work = [(r, p, SamplingParams(**{**vars_of(q), "max_tokens": 14}), a) for r, p, q, a in work]
    preempted: list[str] = []

    def preempt_one(step: int) -> None:
        if step != 1:
            return
        for request_id, request in prefill.scheduler.requests.items():
            if request.in_prompt_phase and request.num_prefilled_tokens >= 8:
                prefill.scheduler.preempt(request_id)
                preempted.append(request_id)
                return

    finished, log = run_streamed(
        prefill, decode, work, on_prefill_step=preempt_one, streamed_only=False
    )
    assert preempted and preempted[0] in log.skipped
    assert len(log.skipped) < len(work)  # some reservations did not fit: those moved whole
    assert_streams_consistent(log, work, finished, 4)
    resent = log.of_plane(preempted[0], 0)
    assert [first for first, _ in resent].count(0) >= 2  # sent again from the start
    assert_match_reference(prefill, work, finished)
    assert decode.scheduler.memory_stats.num_preemptions > 0
    for engine in (prefill, decode):
        assert_all_released(engine)


def vars_of(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_a_sender_that_dies_leaves_nothing(tiny_dir):
    """Mid-stream the prefill side goes away: the decode side releases the reservation (its
    blocks, the chunks written into them) and no half-received K/V is ever used; chunks and
    final hand-offs that do not match a reservation are refused, and so is a chunk naming a
    plane the decode engine does not have."""
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir, enable_prefix_caching=True)
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert decode.reserve_import("a", prompt, params) == 0
    prefill.add_request("a", prompt, params)
    prefill.stream_export("a")
    chunks = []
    while not chunks:
        prefill.step()
        chunks = prefill.take_kv_chunks()
    decode.write_kv_chunk(chunks[0])
    assert decode.kv.num_free_blocks < decode.kv.pool.num_blocks
    planes = decode.kv.num_planes
    stray = dataclasses.replace(chunks[0], planes=(0, planes))  # a plane this engine lacks
    with pytest.raises(InvalidRequestError, match=f"names planes \\(0, {planes}\\)"):
        decode.write_kv_chunk(stray)
    with pytest.raises(InvalidRequestError, match="already in use"):
        decode.reserve_import("a", prompt, params)
    prefill.abort_request("a")  # the prefill replica is gone
    assert prefill.take_kv_chunks() == []
    assert decode.release_import("a")
    assert not decode.release_import("a")
    assert_all_released(decode)
    with pytest.raises(InvalidRequestError, match="no reservation"):
        decode.write_kv_chunk(chunks[0])
    # A streamed final hand-off without its reservation is refused, nothing staged.
    prefill.add_request("b", prompt, params)
    prefill.stream_export("b")
    while not prefill.can_export("b"):
        prefill.step()
        prefill.take_kv_chunks()
    state = prefill.export_request("b")
    assert state.first_block > 0
    with pytest.raises(InvalidRequestError, match="without a reservation"):
        decode.import_request(state)
    assert_all_released(decode) and decode.runner.moves.staged_imports == {}
    assert_all_released(prefill)


def test_abort_while_reserved_or_staged_frees_the_reservation(tiny_dir):
    """A streamed request aborted on the decode side after its final hand-off but before
    admission frees its reserved blocks; a whole hand-off of a reserved request frees the
    reservation it does not need."""
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir, max_num_seqs=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    busy = ("busy", list(range(1, 9)), SamplingParams(max_tokens=30, ignore_eos=True), 0)
    decode.add_request(*busy[:3])
    decode.step()  # "busy" holds the only seat: imports wait
    for request_id, streamed in (("s", True), ("w", False)):
        prompt = list(range(10, 30))
        decode.reserve_import(request_id, prompt, params)
        prefill.add_request(request_id, prompt, params)
        if streamed:
            prefill.stream_export(request_id)
        while not prefill.can_export(request_id):
            prefill.step()
            for chunk in prefill.take_kv_chunks():
                decode.write_kv_chunk(chunk)
        decode.import_request(prefill.export_request(request_id))
    assert set(decode.scheduler.admission.reserved) == {"s"}  # "w" came whole
    decode.step()
    assert decode.abort_request("s").finish_reason == "abort"
    assert decode.abort_request("w").finish_reason == "abort"
    decode.abort_request("busy")
    decode.step()
    assert decode.scheduler.admission.reserved == {}
    assert_all_released(decode)


@pytest.mark.parametrize("arm", sorted(PROMPT_ARMS))
def test_streamed_huginn_equals_reference(huginn_dir, arm):
    """Huginn (prelude and coda groups beside the core's planes; prompts run the request's
    loop bound): streamed tokens and steps equal its reference, with decode-side prefix hits
    keyed by the loop bound."""
    args = dict(
        exit_criterion="latent-diff", prefill_chunk_size=5, enable_prefix_caching=True,
        **PROMPT_ARMS[arm],
    )  # fmt: skip
    prefill = make_engine(huginn_dir, **args)
    decode = make_engine(huginn_dir, num_blocks=9 * 40, **args)
    warm = [("warm", SHARED[:8] + [1, 2], SamplingParams(max_tokens=2, temperature=0.0), 0)]
    run_steps(decode, warm)
    rng = random.Random(61)
    work = []
    for i in range(5):
        prompt = [rng.randrange(128) for _ in range(rng.choice([3, 9, 14]))]
        if i % 2 == 0:
            prompt = SHARED[:8] + prompt
        params = SamplingParams(
            max_tokens=rng.randrange(2, 8),
            temperature=0.0,
            exit_threshold=rng.choice([0.1, 0.2, 1.0]),
            max_loops=None if i % 2 == 0 else rng.choice([None, 6]),
            ignore_eos=True,
        )
        work.append((f"h{i}", prompt, params, 0))
    finished, log = run_streamed(prefill, decode, work)
    assert_matches_reference(prefill, work, finished, "latent-diff")
    assert_streams_consistent(log, work, finished, 4)
    assert any(log.skipped[r] == 2 for r, *_ in work)  # decode-side hits served blocks
    assert sum(log.received(r) for r, *_ in work) > 0
    for engine in (prefill, decode):
        assert_all_released(engine)


def test_an_import_into_a_reservation_is_admitted_past_a_request_waiting_for_blocks(tiny_dir):
    """The decode pool (40 blocks) holds a reservation of 20; a request whose prompt needs 28
    waits at the head of the queue for blocks the reservation holds. The reserved request's
    final hand-off arrives behind it: admitted anyway (its blocks are held already), it
    decodes, finishes and frees them, and then the waiting request runs. Holding the import
    back behind the head would wait forever (how a 1P1D serving test hung)."""
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir, num_blocks=40)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    streamed, big = list(range(3, 19)), list(range(40, 68))  # 16 and 28 prompt tokens
    assert decode.reserve_import("r", streamed, params) == 0
    assert decode.kv.num_free_blocks == 20  # 5 blocks of 4 positions in each of 4 planes
    decode.add_request("big", big, params)
    prefill.add_request("r", streamed, params)
    prefill.stream_export("r")
    finished = {}
    while not prefill.can_export("r"):
        prefill.step()
        for chunk in prefill.take_kv_chunks():
            decode.write_kv_chunk(chunk)
        decode.step()  # "big" does not fit and waits
    assert decode.scheduler.waiting[0].request_id == "big" and not decode.scheduler.running
    decode.import_request(prefill.export_request("r"))
    for _ in range(100):
        for output in decode.step():
            if output.finished:
                finished[output.request_id] = output
        if not decode.has_unfinished_requests():
            break
    assert set(finished) == {"r", "big"}
    assert finished["r"].metrics.finished_s <= finished["big"].metrics.first_token_s
    for request_id, prompt in (("r", streamed), ("big", big)):
        assert finished[request_id].token_ids == reference_for(decode, prompt, params).token_ids
    assert_all_released(decode)
