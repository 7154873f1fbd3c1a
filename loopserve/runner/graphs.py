"""Decode calls through static, row-bucketed buffers; captured as CUDA graphs on CUDA.

A looped model runs the same core weights at every loop, so one captured call per row-count
bucket serves every depth: which plane a row reads and writes is data (the table row it reads,
`slot * planes + depth`, and its write slot), not part of the graph. And because a looped
model pays every per-call host cost once per loop, the captured call is the whole decode loop
step of `runner/decode_rows.py`, not just the core: per bucket B, `DecodeGraphs` holds

- one static input buffer `[NUM_COLUMNS * B + 2 * U]` int64, filled by one host-to-device
  copy per call: the rows' slots, positions, table rows, tokens, loop-0 flags, exit codes,
  CDF columns (float64 bits), coda candidates, and up to U new table entries (U =
  `update_capacity(B, planes)`; a call that gained more writes the rest before the launch);
- the captured step over it: apply the table entries; embed loop-0 rows and gather the
  others' states from their slots; write slots and context lengths; the core (attention over
  the paged tables); write the outputs back to the slots; the hazards (when the exit mode
  reads a gate); the exit decisions (`decide_exits_on_device`) and the LAST_EXITED finalize
  copies (`finalize_pairs`: every row with every deeper plane, masked by the exits); outputs `[B, H]`, hazards and exits stay in
  static tensors for the coda;
- the leave of every row (Ouro's lm_head; Huginn's coda layers and lm_head) and each row's
  argmax, packed with the signals the host reads, so a call whose coda candidates all take
  the argmax reads their tokens in its one copy out and samples nothing; other candidates
  sample from the step's logits.

Each bucket is captured in every form its calls take (`forms`): the leave runs only in calls
with coda candidates (always when a criterion reads logits; never when coda batching in time
runs leaves apart), and a family with once planes runs its prelude layers only in calls
where some row starts a token: a call pays the lm_head's weight read, or Huginn's prelude or
coda layers (each about a core step's weights), only when a row needs them. Over a paged
kernel, the rows of such a call that drop a once plane's output (a prelude of a row that
resumes, a coda of a row that is no candidate) read one position of it, not their context.

Buckets are 1, 2, 4, 8, 16, 24, 32, ... (multiples of 8) up to `max_rows` (`max_num_seqs`,
always its own bucket); a call of n rows runs in the smallest bucket >= n. Padding rows use
the padding slot (`DecodeSlots.padding_slot`): its tables hold only the dummy block, one block
past the scheduler's pool, so padding rows write only there and attend only to what they just
wrote; they embed token 0 and never exit. The context bound `max_context` is `max_model_len`
over the paged Triton kernel (each row reads only its live K/V) and `min(max_model_len,
GRAPH_MAX_CONTEXT)` for the torch backend, which gathers `max_blocks` blocks per row inside a
graph (fixed shapes); calls with a row at a position >= `max_context` run eagerly.

Modes: `emulate` runs the static function eagerly on the padded buffers (any device; CPU
tests prove that padding and buffers change no output); `capture` records one
`torch.cuda.CUDAGraph` per bucket at start-up (largest first, after two warm-up runs on a side
stream, all graphs in one shared memory pool) and replays it. Calls above the largest bucket,
with prompt or replay rows, or with cascade groups run eagerly (the runner checks `fits`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from loopserve.contracts import DecodeRows
from loopserve.exit.columns import CONTINUE, EXIT, GATE
from loopserve.runner.attention.torch_paged import Workspace
from loopserve.runner.decode_rows import (
    DecodeSignals,
    FedBack,
    HostColumns,
    decide_exits_on_device,
    finalize_pairs,
)
from loopserve.runner.decode_slots import DecodeSlots
from loopserve.runner.graph_buffers import (
    BackendFn,
    CoreFn,
    PlaneBuffers,
    bucket_for,
    graph_buckets,
    graph_max_context,
    paged_backend,
    torch_backend,
)
from loopserve.runner.graph_inputs import (
    CANDIDATES,
    CDF,
    CODES,
    NEEDS_GATE,
    POSITIONS,
    SLOTS,
    STARTS,
    SURVIVAL,
    TABLE_INDEX,
    THRESHOLD,
    TOKENS,
    BucketInputs,
    HostBuffers,
    update_capacity,
)
from loopserve.runner.transfers import Transfers

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self,
        core: CoreFn,
        kv_cache: torch.Tensor,
        *,
        prelude: Callable[[torch.Tensor], torch.Tensor],
        hazards: Callable[[torch.Tensor], torch.Tensor] | None,
        finalize: Callable[[torch.Tensor, torch.Tensor], None],
        slots: DecodeSlots,
        transfers: Transfers,
        block_size: int,
        max_context: int,
        max_rows: int,
        dummy_block: int,
        scale: float,
        capture: bool,
        make_backend: BackendFn = torch_backend,
        enter: Callable | None = None,
        leave: Callable | None = None,
        leave_always: bool = False,
        defers_leave: bool = False,
        latent: Callable | None = None,
    ) -> None:
        """`slots`: the runner's decode slots (states and tables the captured step reads and
        writes); `hazards` None: the exit mode reads no gate (exits are the exit codes). A
        family with once planes passes `enter(tokens, positions, once)` and
        `leave(carried, positions, once)` (its prelude and coda attend to its once planes,
        prepared here over the static buffers); a criterion family's decode slots hold its
        criterion (`slots.criterion`), checked inside the step over `latent(carried)`.
        `leave_always`: the step runs `leave` in every call (a criterion that reads logits
        checks its rows from it); else only in calls with coda candidates, and never when
        `defers_leave` (coda batching in time runs held tokens' leaves apart). A family with
        once planes runs `enter` only in calls where some row starts a token. Each bucket is
        captured in every form its calls can take (`forms`)."""
        self.core, self.prelude, self.hazards, self.finalize = core, prelude, hazards, finalize
        self.enter, self.leave, self.latent = enter, leave, latent
        self.leave_always, self.defers_leave = leave_always, defers_leave
        self.criterion = slots.criterion
        self.slots = slots
        self.transfers = transfers
        self.make_backend = make_backend
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scale = scale
        self.num_planes = slots.num_planes
        self.stride = slots.stride  # table rows per slot: loop planes, then once planes
        self.buckets = graph_buckets(max_rows)
        self.max_rows = max_rows
        self.max_blocks = -(-max_context // block_size)
        assert self.max_blocks <= slots.max_blocks, "tables narrower than the graphs' context"
        self.dummy_block = dummy_block
        self.dummy_slot = dummy_block * block_size
        device = kv_cache.device
        self.device = device
        # Shared by every bucket as leading views, filled inside the step.
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.loop_planes = PlaneBuffers(
            max_rows, self.dummy_slot, slots.padding_row, device, seq_lens=self.context_lens
        )
        self.once_planes = [
            PlaneBuffers(max_rows, self.dummy_slot, slots.padding_row, device)
            for _ in range(self.stride - self.num_planes)
        ]
        self.block_tables = slots.tables[:, : self.max_blocks]
        self.padding_table = slots.padding_row
        self.query_index = torch.arange(max_rows, device=device)
        self.paged = make_backend is not torch_backend
        # The torch backend's position mask, [max_blocks * block_size]; paged kernels need none.
        self.span = torch.arange(0 if self.paged else self.max_blocks * block_size, device=device)
        self.workspace = Workspace()
        self.inputs = {
            b: BucketInputs(b, update_capacity(b, self.stride), device) for b in self.buckets
        }
        self.host_buffers = HostBuffers(slots, dummy_block)
        for bucket in self.buckets:
            self._pad(self.inputs[bucket])
        # Per (bucket, *form): the captured step and its static outputs.
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool, bool], tuple] = {}
        self.num_calls = 0  # calls run through the static buffers (replays or emulated)
        self.num_padded_rows = 0
        if capture:
            self.capture()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, rows: int, max_position: int) -> bool:
        """True when a decode call of `rows` rows, the deepest at `max_position`, can run
        through the static buffers."""
        return rows <= self.max_rows and max_position < self.max_blocks * self.block_size

    # ---- the host side of a call ------------------------------------------------------------

    def _pad(self, inputs: BucketInputs) -> None:
        padding = self.host_buffers.padding(inputs.bucket, inputs.capacity)
        inputs.buffer.copy_(torch.from_numpy(padding))

    def stage(self, rows: DecodeRows, host: HostColumns) -> int:
        """Fill the bucket's static buffer for these rows with one host-to-device copy; returns
        the bucket. Table entries beyond the buffer's capacity are written first, apart."""
        n = len(rows)
        bucket = bucket_for(self.buckets, n)
        assert bucket is not None, f"{n} rows exceed the largest bucket {self.max_rows}"
        inputs = self.inputs[bucket]
        buffer, index, values = self.host_buffers.fill(bucket, inputs.capacity, rows, host)
        if index:  # rare: a new slot with a long table
            extra = self.transfers.to_device(index + values)
            self.slots.tables.view(-1).index_copy_(0, extra[: len(index)], extra[len(index) :])
        self.transfers.to_device_into(buffer, inputs.buffer)  # the call's one copy in
        self.num_calls += 1
        self.num_padded_rows += bucket - n
        return bucket

    def feed(self, bucket: int, fed: FedBack) -> None:
        """Put a leave batch's tokens (on the device) into the staged bucket's loop-0 rows
        that wait for them (`decode_rows.FedBack`)."""
        self.inputs[bucket].columns[TOKENS].index_copy_(0, fed.rows_on_device, fed.tokens)

    def forms(self) -> tuple[tuple[bool, bool], ...]:
        """The step's forms, (runs the prelude, runs the leave), that calls can take: a family
        with once planes skips its prelude (layers over the once planes) in a call where no
        row starts a token; the leave (Huginn's coda layers, the lm_head) runs as
        `form` says."""
        enters = (False, True) if self.once_planes else (True,)
        if self.leave is None or (self.defers_leave and not self.leave_always):
            leaves: tuple[bool, ...] = (False,)
        else:
            leaves = (True,) if self.leave_always else (False, True)
        return tuple((e, v) for e in enters for v in leaves)

    def form(self, host: HostColumns) -> tuple[bool, bool]:
        """The form of a call: its prelude when some row starts a token (always for a family
        without once planes: its prelude is the embedding), its leave in every call when it
        is always needed, else when some row is a coda candidate and leaves are not
        deferred."""
        enters = not self.once_planes or len(host.starts) > 0
        leaves = self.leave is not None and (
            self.leave_always or (len(host.candidates) > 0 and not self.defers_leave)
        )
        return enters, leaves

    def launch(self, bucket: int, rows: DecodeRows, host: HostColumns) -> DecodeSignals:
        """Replay (or, emulated, run) the bucket's step in the call's form over its staged
        buffer; the first `len(rows)` rows of its static outputs (read by the coda before
        the next call)."""
        form = self.form(host)
        graph = self.graphs.get((bucket, *form))
        if graph is None:
            out, hazards, exits, logits, fired, packed = self._forward(bucket, *form)
        else:
            graph.replay()
            out, hazards, exits, logits, fired, packed = self.outputs[(bucket, *form)]
        n = len(rows)
        gate = exits if host.gate_decides else None
        return DecodeSignals(
            rows, out[:n], None if hazards is None else hazards[:n],
            None if gate is None else gate[:n], host.candidates,
            self.inputs[bucket].columns[CANDIDATES], self.positions[:n],
            fired=None if fired is None else fired[:n], packed=packed,
            row_logits=None if logits is None else logits[:n], greedy=logits is not None,
        )  # fmt: skip

    # ---- the captured step ------------------------------------------------------------------

    def _planes(self, planes: PlaneBuffers, bucket: int, table_index, keep=None) -> None:
        """Fill a plane set's static write slots and table rows for the bucket's rows; rows
        not kept (`keep` False) write only the dummy slot and, over a paged kernel, read one
        position."""
        size, positions = self.block_size, self.positions[:bucket]
        blocks = self.block_tables[table_index, positions // size]
        slots = blocks * size + positions % size
        if keep is not None:
            slots = torch.where(keep, slots, torch.full_like(slots, self.dummy_slot))
            if self.paged:
                lens = self.context_lens[:bucket]
                planes.seq_lens[:bucket].copy_(torch.where(keep, lens, torch.ones_like(lens)))
        planes.table_index[:bucket].copy_(table_index)
        planes.write_slots[:bucket].copy_(slots)

    def _once(self, bucket: int, slots: torch.Tensor, keep: torch.Tensor) -> list:
        """The once planes' attention over the bucket's rows; only `keep` rows write."""
        calls = []
        for j, planes in enumerate(self.once_planes):
            self._planes(planes, bucket, slots * self.stride + self.num_planes + j, keep)
            calls.append(self.make_backend(self, bucket, planes))
        return calls

    def _forward(self, bucket: int, enters: bool, leaves: bool):
        inputs = self.inputs[bucket]
        columns, floats = inputs.columns, inputs.floats
        slots, positions, table_index = columns[SLOTS], columns[POSITIONS], columns[TABLE_INDEX]
        self.slots.tables.view(-1).index_copy_(0, inputs.updates[0], inputs.updates[1])
        self.positions[:bucket].copy_(positions)
        self.context_lens[:bucket].copy_(positions + 1)
        starts = columns[STARTS] != 0
        hidden = self.slots.hidden.index_select(0, slots)  # resumed from the slots
        if enters:
            if self.once_planes:  # every row's prelude; only rows that start write its K/V
                once = self._once(bucket, slots, starts)
                embedded = self.enter(columns[TOKENS], self.positions[:bucket], once)
            else:
                embedded = self.prelude(columns[TOKENS])
            hidden = torch.where(starts[:, None], embedded, hidden)
        size = self.block_size
        self._planes(self.loop_planes, bucket, table_index)
        attn = self.make_backend(self, bucket, self.loop_planes)
        out = self.core(hidden, self.positions[:bucket], attn)
        self.slots.hidden.index_copy_(0, slots, out)
        codes, checked = columns[CODES], columns[NEEDS_GATE] != 0
        hazards = logits = fired = None
        if leaves:  # the coda of every row; only candidates and checked rows write its K/V
            # (a row's coda attends to its own position)
            keep = (codes != CONTINUE) | checked
            logits = self.leave(out, self.positions[:bucket], self._once(bucket, slots, keep))
        if self.criterion is not None:
            hazards, fired = self.criterion.check_rows(
                slots, self.latent(hidden), starts, self.latent(out), logits,
                floats[THRESHOLD], checked,
            )  # fmt: skip
            exits = (codes == EXIT) | ((codes == GATE) & fired)
        elif self.hazards is None:
            exits = codes == EXIT
        else:
            hazards = self.hazards(out).float()
            exits = decide_exits_on_device(
                codes, floats[CDF], floats[SURVIVAL], floats[THRESHOLD], hazards
            )
        if self.num_planes > 1:  # every row with every deeper plane: fixed shapes
            deeper = self.num_planes - 1
            planes = torch.arange(1, self.num_planes, device=slots.device)
            src_rows = table_index.repeat(deeper)
            dst_rows = slots.repeat(deeper) * self.stride + planes.repeat_interleave(bucket)
            finalize_pairs(
                self.slots.tables, src_rows=src_rows, dst_rows=dst_rows,
                blocks=(positions // size).repeat(deeper), offsets=(positions % size).repeat(deeper),
                keep=(dst_rows > src_rows) & exits.repeat(deeper), block_size=size,
                finalize=self.finalize,
            )  # fmt: skip
        # What the host reads of the signals, packed inside the step (`DecodeSignals.packed`)
        # so that the host launches no conversion of its own: the exits, hazards and where a
        # criterion fired (each when the host does not know it: nothing of these when the
        # exits are the plans'), then every row's greedy token when the step ran the leave
        # (a call whose candidates all take the argmax reads them and samples nothing).
        read = [part for part in (hazards, fired) if part is not None]
        if logits is not None:
            read.append(torch.argmax(logits, dim=-1))
        packed = torch.stack([part.double() for part in [exits, *read]]) if read else None
        return out, hazards, exits, logits, fired, packed

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one CUDA graph per bucket, largest first, in one shared memory pool.

        Inputs during warm-up and capture are all padding rows (they write only the dummy
        block). Warm-up runs first on one side stream (created once, so no stream per bucket
        keeps cached memory outside the plan) so lazy initialisation (cuBLAS handles, Triton
        compiles, the attention workspace at its largest size) happens outside the capture;
        capturing the largest bucket first lets smaller graphs reuse its pool memory.
        Garbage collection is off during capture (a collection could free tensors whose
        memory the graph is recording), and everything runs under the engine's device, so a
        `cuda:1` engine captures on its own GPU."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graph capture needs a CUDA device; use graph_mode=emulate")
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.device(self.device):
                pool = torch.cuda.graph_pool_handle()
                stream = torch.cuda.Stream(self.device)
                for key in [(b, *form) for b in sorted(self.buckets, reverse=True)
                            for form in self.forms()]:  # fmt: skip
                    self._pad(self.inputs[key[0]])
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        for _ in range(2):
                            self._forward(*key)
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs[key] = self._forward(*key)
                    self.graphs[key] = graph
                torch.cuda.synchronize(self.device)
        finally:
            if gc_was_enabled:
                gc.enable()
        self.num_calls = self.num_padded_rows = 0


def build_decode_graphs(
    graph_mode: str, core, kv_cache: torch.Tensor, *, attention, max_model_len: int, **kwargs
) -> tuple[DecodeGraphs | None, str | None]:
    """The runner's decode graphs for `graph_mode` ('off': none; 'emulate': static buffers,
    run eagerly; 'capture': CUDA graphs) and the capture error, if capturing failed (decode
    then runs eagerly: the failure is logged once, loudly, and reported, not raised).
    `attention` is the runner's backend: one with `graph_call` (Triton) runs inside the
    graphs over the static buffers; otherwise the torch gather does."""
    if graph_mode == "off":
        return None, None
    paged = hasattr(attention, "graph_call")
    graphs = DecodeGraphs(
        core,
        kv_cache,
        capture=False,
        make_backend=paged_backend(attention) if paged else torch_backend,
        max_context=graph_max_context(paged, max_model_len),
        **kwargs,
    )
    if graph_mode == "capture":
        start_s = time.perf_counter()
        try:
            graphs.capture()
        except Exception as err:  # keep serving eagerly; say why, once, loudly
            logger.exception("CUDA graph capture failed; decode runs eagerly")
            return None, f"{type(err).__name__}: {err}"
        logger.info(
            "captured %d decode graphs (%d row buckets up to %d rows x %d forms) in %.1f s",
            len(graphs.graphs), len(graphs.buckets), graphs.max_rows, len(graphs.forms()),
            time.perf_counter() - start_s,
        )  # fmt: skip
    return graphs, None
