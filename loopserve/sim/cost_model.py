"""Roofline cost of one core call, one coda and one sampling pass, from first principles.

For every kernel group the model counts the HBM bytes it must move and the FLOPs it must do,
and prices it as `max(bytes / (bw · eff_bw), flops / (peak · eff_peak)) + call_overhead`.
`roofline="phase"` instead prices a core call's linear layers (weights, embeddings, GEMM
FLOPs) and its attention (KV traffic, attention FLOPs) separately and adds them: a bound on
how much the single-roofline default flatters calls that mix compute- and memory-bound rows.

Core call over `rows` rows (each row: a position of one request at one depth):
- weight bytes: the L core layers + the final norm, read once per call; plus one embedding
  row per prelude row (an embedding lookup reads only the rows it gathers);
- KV bytes read: per decode row, its context (`position + 1` positions) of its depth's plane;
  per prompt item, its context (`token_start + token_count` positions) once per item
  (a flash-attention kernel streams a chunk's KV once per item, not once per query row);
- KV bytes written: one position per row in its plane; finalize copies (LAST_EXITED, a decode
  token that exits at depth e < D-1) read and write one position per deeper plane;
- FLOPs: `2 · core_params · rows` (every weight multiplies every row once) plus attention
  `4 · L · num_heads · head_dim · Σ_rows context` (QKᵀ and PV, 2 FLOPs per multiply-add).
Coda: the lm_head is read once if any row exits, `2 · vocab · hidden` FLOPs per row, logits
written in float32. Sampling: logits read once, ~5 FLOPs per vocab entry per row.

Families with attention outside the core (Huginn: a prelude and a coda of transformer
layers, one K/V entry per position) add, per prelude row, those layers' weights (once per
call), FLOPs and attention over the row's context; the coda of each exiting row does the same
before the lm_head. With `coda_every_loop` (an exit criterion that reads the next-token
distribution after every step, like Huginn's KL) every core call also runs the coda and the
lm_head over all its rows.

Kernel count (when the device profile prices it, `DeviceProfile.kernel_s` > 0): every device
kernel a call launches costs `kernel_s` beyond the roofline (inside a CUDA graph a small
kernel still pays its launch gap, ramp-up and tail). A core call launches `per_layer x
layers + per_loop` kernels (`KERNEL_COUNTS`: counted by dispatch on CPU, `loopserve bench
kernels`; a prelude row adds the prelude layers' kernels, at the core's per-layer count: the
same blocks), a coda `CODA_KERNELS` plus its layers', a sampling pass `SAMPLING_KERNELS`.

Not modelled (documented in docs/simulator.md): activation traffic between kernels, the exit
gate (`hidden + 1` weights, negligible) and attention-kernel inefficiency at short contexts.
This module is pure arithmetic: no tensors, no scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.errors import ConfigError
from loopserve.models.config import OuroConfig, once_kv_planes
from loopserve.models.family import LoopedConfig
from loopserve.models.huginn_config import HuginnConfig
from loopserve.sim.hardware import DeviceProfile

ROOFLINES = ("call", "phase")
# Device kernels of one decode loop: (per core layer, per loop besides the layers), counted by
# dispatch on CPU under graph emulation with views left out (`loopserve bench kernels`, the
# split from counts at two core depths, the model as the runner prepares it on CUDA with the
# Triton attention backend; measured 2026-12-06: Ouro 9 + 6 and Huginn 9 + 7 with merged
# projections, fused norms, SiLU-and-multiply and rotary inside the K/V write, Huginn's
# rotary frequencies computed once and its adapter reading the carried state as it is
# (2026-12-04, before those two: Huginn 9 + 13); 10 + 6 and 10 + 13 with rotary and the
# write apart. Earlier builds, counted with the torch attention
# backend: Ouro 61 + 17, 58 + 17 with merged projections, 26 + 10 with fused norms; Huginn
# 77 + 13, 45 + 14 with fused norms). `DeviceProfile.kernels_per_layer` models another build;
# tests/test_kernel_count.py checks these against the counter.
KERNEL_COUNTS = {"ouro": (9.0, 6.0), "huginn": (9.0, 7.0)}
# With the runner's `fused_linears` (`simulate --fused-linears`), for core calls of up to
# FUSED_LINEAR_MAX_ROWS rows (wider calls keep the counts above), measured 2026-12-06: 5 per
# layer, and per loop Ouro's last add + norm, Huginn's adapter, concatenation and last norm
# (the rotary tables are read by position inside the fused GEMM).
FUSED_LINEAR_KERNEL_COUNTS = {"ouro": (5.0, 1.0), "huginn": (5.0, 3.0)}
FUSED_LINEAR_MAX_ROWS = 16  # runner/fused_linear.py's MAX_ROWS
# Kernels more per core layer with an 8-bit cache (`kv_cache_dtype` fp8), outside the fused
# linears' calls: Huginn's interleaved rotary writes no K/V then (Triton 3.6 spills it with
# the encoding) and `write_kv` does; counted by `bench kernels --kv-cache-dtype fp8_e4m3`,
# 2026-12-06: Ouro 9 + 6 as without it, Huginn 10 + 7 against 9 + 7.
FP8_WRITE_KERNELS = {"ouro": 0.0, "huginn": 1.0}
CODA_KERNELS = 2  # final norm (when the coda has layers) and the lm_head
SAMPLING_KERNELS = 6  # softmax, filtering, the draw, the argmax, the gathers
LOGIT_BYTES = 4  # the coda writes float32 logits for the sampler
SAMPLE_FLOPS_PER_ENTRY = 5  # max, exp, sum, scale, draw/compare per vocab entry

# Ouro-1.4B (ByteDance/Ouro-1.4B config.json): 24 layers x 4 loops, MHA, untied lm_head.
OURO_1P4B = OuroConfig(
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    total_ut_steps=4,
    head_dim=128,
    rope_theta=1_000_000.0,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
    eos_token_id=(0,),
)
# Ouro-2.6B: Ouro-1.4B's shape with 48 layers (the published 2.6B config.json was not
# available to this project; the 48-layer count is the public model card's).
OURO_2P6B = OuroConfig(**{**OURO_1P4B.__dict__, "num_hidden_layers": 48})
# Huginn-0125 (the authors' recpre/raven_config_minimal.json): 2 prelude + 4 core (r = 32)
# + 2 coda layers of width 5280, 55 heads, tied 65,536-token embedding.
HUGINN_0125 = HuginnConfig(
    vocab_size=65536,
    n_embd=5280,
    n_heads=55,
    intermediate_size=17920,
    n_layers_in_prelude=2,
    n_layers_in_recurrent_block=4,
    n_layers_in_coda=2,
    mean_recurrence=32,
    block_size=4096,
    tie_embeddings=True,
)
PRESETS = {"ouro-1.4b": OURO_1P4B, "ouro-2.6b": OURO_2P6B, "huginn-0125": HUGINN_0125}


def sim_model_config(name_or_path: str | None) -> LoopedConfig:
    """A preset name, a config.json path (any registered family) or None (Ouro-1.4B)."""
    if name_or_path is None:
        return OURO_1P4B
    if name_or_path.lower() in PRESETS:
        return PRESETS[name_or_path.lower()]
    from loopserve.models.registry import read_config

    return read_config(name_or_path)[1]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a looped model the cost model needs, with derived byte counts.
    `num_layers` are the core's (run once per loop); `prelude_layers` / `coda_layers` run once
    per position with K/V of their own (0 for Ouro, whose prelude is the embedding and coda
    the lm_head); `step_extra_params` are read once per loop besides the layers (Ouro's final
    norm, Huginn's adapter)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_loops: int
    dtype_bytes: int = 2  # BF16
    kv_dtype_bytes: int | None = None  # the K/V element's (None: dtype_bytes; fp8: 1)
    prelude_layers: int = 0
    coda_layers: int = 0
    step_extra_params: int | None = None  # None: the final norm (hidden_size)
    tied_embeddings: bool = False
    gate_params: int | None = None  # a learned exit head's; None: Ouro's (hidden_size + 1)
    kernels_per_layer: float = 0.0  # `KERNEL_COUNTS` of the family
    kernels_per_loop: float = 0.0
    fused_kernels: tuple[float, float] = (0.0, 0.0)  # `FUSED_LINEAR_KERNEL_COUNTS`'

    @classmethod
    def from_config(
        cls, config: LoopedConfig, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None
    ) -> ModelShape:
        """The shape of any family's config, read through the `LoopedConfig` seam;
        `kv_dtype_bytes`: a K/V element's bytes when the cache stores another type."""
        # An 8-bit cache launches the same kernels (its writes encode in-kernel, `fp8_bits`)
        # but for Huginn's interleaved rotary, whose K/V write it leaves to `write_kv`.
        per_layer, per_loop = _kernel_counts(config)
        if kv_dtype_bytes is not None and kv_dtype_bytes < dtype_bytes:
            per_layer += FP8_WRITE_KERNELS[_family(config)]
        return cls(
            num_layers=config.num_core_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            num_loops=config.num_loops,
            dtype_bytes=dtype_bytes,
            kv_dtype_bytes=kv_dtype_bytes,
            prelude_layers=config.num_prelude_layers,
            coda_layers=config.num_coda_layers,
            step_extra_params=config.step_extra_params,
            tied_embeddings=config.tie_word_embeddings,
            gate_params=config.exit_gate_params,
            kernels_per_layer=per_layer,
            kernels_per_loop=per_loop,
            fused_kernels=FUSED_LINEAR_KERNEL_COUNTS[_family(config)],
        )

    @property
    def layer_params(self) -> int:
        """q, k, v, o projections + SwiGLU (gate, up, down) + the four RMSNorm weights."""
        hidden, q_dim = self.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
        mlp = 3 * hidden * self.intermediate_size
        return attention + mlp + 4 * hidden

    @property
    def core_params(self) -> int:
        """Weights one loop reads: every core layer plus the final `model.norm` (Ouro) or
        the adapter (Huginn)."""
        extra = self.hidden_size if self.step_extra_params is None else self.step_extra_params
        return self.num_layers * self.layer_params + extra

    @property
    def prelude_params(self) -> int:
        return self.prelude_layers * self.layer_params

    @property
    def coda_params(self) -> int:
        """The coda's transformer layers and final norm (without the lm_head)."""
        return self.coda_layers * self.layer_params + (self.hidden_size if self.coda_layers else 0)

    @property
    def vectors_per_row(self) -> int:
        """Hidden vectors a row in flight keeps between loops: its state, plus the prelude
        output a family injects at every step (Huginn)."""
        return 2 if self.prelude_layers else 1

    @property
    def once_layers(self) -> int:
        """Layers with one K/V entry per position (prelude and coda)."""
        return self.prelude_layers + self.coda_layers

    @property
    def extra_kv_planes(self) -> int:
        """Planes of `num_layers` layers each that hold the once-per-position K/V: the
        engine's formula (`once_kv_planes`), so both plan memory alike."""
        return once_kv_planes(self.once_layers, self.num_layers)

    @property
    def core_weight_bytes(self) -> int:
        return self.core_params * self.dtype_bytes

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_weight_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def total_weight_bytes(self) -> int:
        """Resident weights: embedding, prelude, core, coda, lm_head (once when tied), gate."""
        gate = self.hidden_size + 1 if self.gate_params is None else self.gate_params
        embeddings = (1 if self.tied_embeddings else 2) * self.embedding_params
        params = self.core_params + self.prelude_params + self.coda_params + embeddings + gate
        return params * self.dtype_bytes

    @property
    def kv_element_bytes(self) -> int:
        return self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes

    @property
    def kv_bytes_per_token_per_depth(self) -> int:
        return self.layer_kv_bytes(self.num_layers)

    @property
    def kv_bytes_per_token_once(self) -> int:
        """K/V one position stores in the prelude and coda layers (not per loop)."""
        return self.layer_kv_bytes(self.once_layers)

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query row, key position) pair over all layers: QKᵀ + PV."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def layer_pair_flops(self, layers: int) -> int:
        return 4 * layers * self.num_heads * self.head_dim

    def layer_kv_bytes(self, layers: int) -> int:
        """K/V bytes of one position in `layers` layers."""
        return 2 * layers * self.num_kv_heads * self.head_dim * self.kv_element_bytes


def kv_element_bytes(kv_cache_dtype: str) -> int | None:
    """A K/V element's bytes under an engine's `kv_cache_dtype` (None: the model's dtype)."""
    return None if kv_cache_dtype == "auto" else 1  # fp8_e4m3, fp8_e5m2


def _family(config: LoopedConfig) -> str:
    return "huginn" if isinstance(config, HuginnConfig) else "ouro"


def _kernel_counts(config: LoopedConfig) -> tuple[float, float]:
    return KERNEL_COUNTS[_family(config)]


@dataclass(frozen=True, slots=True)
class CallCost:
    bytes_moved: float
    flops: float
    time_s: float  # including the per-call overhead
    compute_bound: bool  # limited by FLOPs rather than bytes (the linear phase, if split)


NO_COST = CallCost(0.0, 0.0, 0.0, False)


class CostModel:
    """Prices kernel groups on one `DeviceProfile` for one `ModelShape`."""

    def __init__(self, shape: ModelShape, device: DeviceProfile, roofline: str = "call") -> None:
        if roofline not in ROOFLINES:
            raise ConfigError(f"roofline must be one of {', '.join(ROOFLINES)}, got {roofline!r}")
        self.shape = shape
        self.device = device
        self.split_phases = roofline == "phase"
        self._bw = device.effective_bandwidth
        self._flops = device.effective_flops
        self._overhead_s = device.call_overhead_s
        self._kv = shape.kv_bytes_per_token_per_depth
        self._embed_row_bytes = shape.hidden_size * shape.dtype_bytes
        self._pair_flops = shape.attention_flops_per_pair
        self._linear_flops_per_row = 2 * shape.core_params
        self._kernel_s = device.kernel_s
        per_layer = shape.kernels_per_layer
        if device.kernels_per_layer is not None:
            per_layer = device.kernels_per_layer
        self._layer_kernels = per_layer
        self.core_kernels = per_layer * shape.num_layers + shape.kernels_per_loop
        # `DeviceProfile.fused_linears`: narrow core calls launch the fused build's kernels.
        self.fused_core_kernels = self._fused_layer_kernels = None
        if device.fused_linears:
            fused_layer, fused_loop = shape.fused_kernels
            self.fused_core_kernels = fused_layer * shape.num_layers + fused_loop
            self._fused_layer_kernels = fused_layer

    def _once_layer_kernels(self, rows: int) -> float:
        """Kernels of one prelude or coda layer over `rows` rows (the same blocks as the
        core's: the fused build's per-layer count on narrow calls)."""
        if self._fused_layer_kernels is not None and rows <= FUSED_LINEAR_MAX_ROWS:
            return self._fused_layer_kernels
        return self._layer_kernels

    def _kernels_s(self, kernels: float) -> float:
        return kernels * self._kernel_s

    def _price(self, bytes_moved: float, flops: float) -> CallCost:
        memory_s, compute_s = bytes_moved / self._bw, flops / self._flops
        return CallCost(
            bytes_moved, flops, max(memory_s, compute_s) + self._overhead_s, compute_s > memory_s
        )

    def core_call(
        self,
        *,
        rows: int,
        prelude_rows: int = 0,
        kv_read_positions: int = 0,
        attention_pairs: int = 0,
        finalize_copies: int = 0,
        prelude_kv_read: int = 0,
        prelude_pairs: int = 0,
    ) -> CallCost:
        """One core call. `kv_read_positions`: positions of KV read, summed over items;
        `attention_pairs`: Σ over rows of their context length; `finalize_copies`:
        (position, plane) copies of early-exited decode tokens; `prelude_kv_read` /
        `prelude_pairs`: the same for the prelude rows' prelude layers (families with one)."""
        shape = self.shape
        linear_bytes = shape.core_weight_bytes + prelude_rows * self._embed_row_bytes
        kv_bytes = (kv_read_positions + rows + 2 * finalize_copies) * self._kv
        linear_flops = self._linear_flops_per_row * rows
        attention_flops = self._pair_flops * attention_pairs
        if shape.prelude_layers and prelude_rows:
            linear_bytes += shape.prelude_params * shape.dtype_bytes
            linear_flops += 2 * shape.prelude_params * prelude_rows
            kv_bytes += (prelude_kv_read + prelude_rows) * shape.layer_kv_bytes(
                shape.prelude_layers
            )
            attention_flops += shape.layer_pair_flops(shape.prelude_layers) * prelude_pairs
        kernels = self.core_kernels
        if self.fused_core_kernels is not None and rows <= FUSED_LINEAR_MAX_ROWS:
            kernels = self.fused_core_kernels
        if shape.prelude_layers and prelude_rows:
            kernels += self._once_layer_kernels(rows) * shape.prelude_layers
        if not self.split_phases:
            return self._with_kernels(
                self._price(linear_bytes + kv_bytes, linear_flops + attention_flops), kernels
            )
        # Linear layers and attention are separate kernels: each pays its own roofline, so
        # KV traffic cannot hide under GEMM compute (or weight reads under attention math).
        linear = self._price(linear_bytes, linear_flops)
        attention = self._price(kv_bytes, attention_flops)
        return self._with_kernels(
            CallCost(
                linear_bytes + kv_bytes,
                linear_flops + attention_flops,
                linear.time_s + attention.time_s - self._overhead_s,
                linear.compute_bound,
            ),
            kernels,
        )

    def _with_kernels(self, cost: CallCost, kernels: float) -> CallCost:
        """`cost` plus the device time of `kernels` kernels (nothing when not priced)."""
        if not self._kernel_s:
            return cost
        return CallCost(
            cost.bytes_moved, cost.flops, cost.time_s + self._kernels_s(kernels),
            cost.compute_bound,
        )  # fmt: skip

    def coda(
        self,
        rows: int,
        *,
        layer_rows: int | None = None,
        kv_read_positions: int = 0,
        attention_pairs: int = 0,
    ) -> CallCost:
        """lm_head over `rows` exiting rows (zero cost when nothing runs). A family with coda
        layers runs them first over `layer_rows` rows (default `rows`: a prompt's coda runs
        over every position, for their K/V, and the lm_head only on the last), reading
        `kv_read_positions` and attending over `attention_pairs`."""
        shape = self.shape
        layer_rows = rows if layer_rows is None else layer_rows
        if rows == 0 and (layer_rows == 0 or not shape.coda_layers):
            return NO_COST
        bytes_moved = (
            shape.lm_head_weight_bytes
            + rows * shape.hidden_size * shape.dtype_bytes
            + rows * shape.vocab_size * LOGIT_BYTES
        )
        flops = 2 * shape.vocab_size * shape.hidden_size * rows
        kernels = float(CODA_KERNELS)
        if shape.coda_layers and layer_rows:
            bytes_moved += shape.coda_params * shape.dtype_bytes
            bytes_moved += (kv_read_positions + layer_rows) * shape.layer_kv_bytes(
                shape.coda_layers
            )
            flops += 2 * shape.coda_params * layer_rows
            flops += shape.layer_pair_flops(shape.coda_layers) * attention_pairs
            kernels += self._once_layer_kernels(layer_rows) * shape.coda_layers
        return self._with_kernels(self._price(bytes_moved, flops), kernels)

    def sampling(self, rows: int) -> CallCost:
        if rows == 0:
            return NO_COST
        vocab = self.shape.vocab_size
        cost = self._price(rows * vocab * LOGIT_BYTES, SAMPLE_FLOPS_PER_ENTRY * rows * vocab)
        return self._with_kernels(cost, SAMPLING_KERNELS)

    def decode_loop_time(self, batch_size: int, context: int) -> float:
        """Seconds of one decode core call: `batch_size` rows, each with `context` positions."""
        return self.core_call(
            rows=batch_size,
            kv_read_positions=batch_size * context,
            attention_pairs=batch_size * context,
        ).time_s

    def linear_ridge_rows(self) -> float:
        """Rows per call from which the core's weight GEMMs are compute-bound."""
        bytes_per_row = self.shape.core_weight_bytes / self._bw
        return bytes_per_row / (self._linear_flops_per_row / self._flops)
