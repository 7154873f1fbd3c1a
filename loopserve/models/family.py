"""The model-family seam: what every looped family's config and model provide.

A looped model is a prelude (embedding, and for some families attention layers run once
per position), a core of `num_core_layers` layers run once per loop (D = `num_loops` loops,
each writing its own K/V plane under LAST_EXITED), an exit signal read after a loop (Ouro's
hazard gate, Huginn's convergence criteria: `exit/`), and a coda (for some families attention
layers once per position, then the LM head). The KV manager, the simulator's cost model and
the engine's memory plan read a family only through `LoopedConfig`; the loader builds its
model through `models/registry.py`; an executor in `runner/` runs its per-loop API (one
executor per family: Ouro's `ModelRunner`, Huginn's `HuginnRunner`, because their preludes
and codas differ in kind: an embedding and an lm_head, or attention layers with K/V of
their own and a state injected at every step).
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
    """What the engine reads of a loaded model of any family (`LLMEngine`, the memory plan):
    its `config` (`LoopedConfig`), `num_loops`, `lm_head` (its weight's dtype and device are
    the model's), the `checkpoint_dir` it was loaded from, and `profile_forward`, one pass of
    every part over rows (prelude, one loop, exit signal, coda) for the memory plan's
    activation peak. The per-loop API that serving runs (prelude, a core step at a loop over a
    set of rows, the exit signal, the coda) is the family's own, run by the family's executor
    in `runner/`: Ouro's prelude is an embedding and its coda an lm_head, Huginn's are
    attention layers with K/V of their own around a state injected at every step."""

    config: Any
    checkpoint_dir: Path

    @property
    def num_loops(self) -> int: ...

    @property
    def lm_head(self) -> Any: ...

    def profile_forward(self, token_ids: Any, positions: Any, attn: Any) -> Any: ...
