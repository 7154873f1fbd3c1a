"""The model-family seam: what every looped family's config and model provide.

A looped model is a prelude (embedding, and for some families attention layers run once
per position), a core of `num_core_layers` layers run once per loop (D = `num_loops` loops,
each writing its own K/V plane under LAST_EXITED), an exit signal read after a loop (Ouro's
hazard gate, Huginn's convergence criteria: `exit/`), and a coda (for some families attention
layers once per position, then the LM head). The KV manager, the simulator's cost model and
the engine's memory plan read a family only through `LoopedConfig`; the loader builds its
model through `models/registry.py`; the one executor, `runner/model_runner.py`, runs every
family through `LoopedModel`'s math: a family supplies its math, the runner owns every
feature (paged K/V, decode slots, exits, sampling, swap, hand-off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path


@runtime_checkable
class LoopedConfig(Protocol):
    """A family's parsed `config.json` as the engine and the tools read it.

    - Shape: `hidden_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
      `intermediate_size`, `vocab_size`, `max_position_embeddings`, `tie_word_embeddings`.
    - Loops: `num_loops` (D, the default loop bound; a request may ask for fewer),
      `num_core_layers` (layers one loop runs, one K/V plane each loop).
    - Once-per-position layers: `num_prelude_layers` / `num_coda_layers` (attention layers
      run once per position, before and after the loops; 0 for Ouro), whose K/V fills
      `extra_kv_planes` planes of `num_core_layers` layers each.
    - Weights a loop reads besides its layers: `step_extra_params` (Ouro's final norm,
      Huginn's adapter); `exit_gate_params`: a learned exit head's (0 without one).
    - `kv_bytes_per_block(block_size, element_size)`: one block of one plane;
      `with_loops(n)`: the same model at D = n.
    - `eos_token_id`: a tuple of ids.
    """

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    @property
    def num_loops(self) -> int: ...

    @property
    def num_core_layers(self) -> int: ...

    @property
    def num_prelude_layers(self) -> int: ...

    @property
    def num_coda_layers(self) -> int: ...

    @property
    def extra_kv_planes(self) -> int: ...

    @property
    def step_extra_params(self) -> int: ...

    @property
    def exit_gate_params(self) -> int: ...

    @property
    def eos_token_id(self) -> tuple[int, ...]: ...

    def kv_bytes_per_block(self, block_size: int, element_size: int) -> int: ...

    def with_loops(self, num_loops: int) -> LoopedConfig:
        """The same config run at most `num_loops` loops per token (the engine's
        `num_loops`; the weights do not depend on it)."""
        ...


@runtime_checkable
class LoopedModel(Protocol):
    """A loaded model of any family: what the engine reads (`config`, `num_loops`, `lm_head`,
    whose weight's dtype and device are the model's, the `checkpoint_dir` it was loaded from,
    `profile_forward` for the memory plan's activation peak) and the math the one executor
    runs. The math, all of a family's own:

    - Carried state: each row carries `state_width` columns from loop to loop (Ouro: the
      hidden state; Huginn: the recurrent state and the injected prelude output).
    - K/V groups: every plane holds `kv_layers` layers; loop planes keep the core's K/V per
      loop, and `config.extra_kv_planes` once planes after them keep the K/V of layers run
      once per position (Huginn's prelude and coda; none for Ouro).
    - `signal_kind`: "hazard" (a per-loop exit probability folded by the CDF rule:
      `hazard_fn(lookahead_seed)` returns it over carried rows, [rows] float32) or "criterion" (a convergence score checked against a threshold by
      `exit/criteria.py`, over `latent(carried)` and, for some criteria, `leave`'s logits).
    - `enter(token_ids, positions, once, initial)`: the rows' carried state before loop 0
      (`once`: the attention of the once planes, one prepared call per plane; `initial`:
      a family's initial recurrent state when it is drawn, else None).
    - `loop(carried, positions, attn)`: one loop over a flat set of rows at any loop indices
      (which plane a row uses is the attention's data): the graph-capture unit.
    - `leave(carried, positions, once)`: logits [rows, vocab]. `leave_writes_kv`: it writes
      K/V (once planes), so it runs for every position that completes, not only for rows
      that sample.
    - `make_rows_invariant()`: the family's own part of batch-invariant mode, after the
      runner made its linears and SiLUs row by row.
    - Only where they apply (not protocol members, so `isinstance` holds for every family):
      `hazard_fn(lookahead_seed)` for a hazard family, `initial_state(e, init_scale,
      generator)` for a family whose initial recurrent state is drawn (`init_scale` > 0),
      `merge_projections()` for a family whose checkpoint keeps projections of one input
      apart (Ouro's q/k/v and gate/up; the loader calls it last on CUDA, so they run as
      one GEMM; on CPU the wider GEMM measured slower).
    A hand-off carries K/V of every plane, the sampler and what the runner keeps per request
    (drawn initial states, the `full` lookup's record); the math keeps nothing per request.
    """

    config: Any
    checkpoint_dir: Path
    signal_kind: str
    leave_writes_kv: bool

    @property
    def num_loops(self) -> int: ...

    @property
    def lm_head(self) -> Any: ...

    @property
    def state_width(self) -> int: ...

    @property
    def kv_layers(self) -> int: ...

    def enter(self, token_ids: Any, positions: Any, once: Any, initial: Any = None) -> Any: ...

    def loop(self, carried: Any, positions: Any, attn: Any) -> Any: ...

    def latent(self, carried: Any) -> Any: ...

    def leave(self, carried: Any, positions: Any, once: Any) -> Any: ...

    def make_rows_invariant(self) -> None: ...

    def profile_forward(self, token_ids: Any, positions: Any, attn: Any) -> Any: ...


def once_weight(config: LoopedConfig) -> float:
    """The once-per-token layers' weight in loops: (prelude + coda layers) / core layers
    (every layer of a family has the core's shape; the lm_head, read by every leave, is left
    out). Huginn-0125: (2 + 2) / 4 = 1.0; Ouro: 0. Coda batching in time reads it."""
    return (config.num_prelude_layers + config.num_coda_layers) / config.num_core_layers


def table_positions(config: LoopedConfig, max_positions: int | None) -> int:
    """Positions a model's precomputed position tables cover (the fused linears' rotary
    cos/sin): the engine's length bound when given (longer than the checkpoint's
    `max_position_embeddings` only where the engine allowed it,
    `engine.model_setup.check_max_model_len`), else the checkpoint's."""
    return max_positions or config.max_position_embeddings
