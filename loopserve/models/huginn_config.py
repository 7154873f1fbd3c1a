"""Huginn-0125's `config.json` (`HuginnConfig`): the checkpoint's own names and the names
the rest of loopserve reads from any family's config (hidden size, heads, loops, layer
groups, K/V planes). Torch-free, so the simulator's cost model reads a Huginn shape without
the model's modules; the model itself is `models/huginn.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from loopserve.errors import ModelLoadError
from loopserve.models.config import ConfigFile, once_kv_planes

HUGINN_MODEL_TYPE = "huginn_raven"

# Parts of the authors' config that select code paths; loopserve implements one value of each.
_FIXED_CHOICES = {
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
}


@dataclass(frozen=True)
class HuginnConfig(ConfigFile):
    vocab_size: int
    n_embd: int
    n_heads: int
    intermediate_size: int
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    mean_recurrence: int = 32
    norm_eps: float = 1e-6
    rope_base: float = 50_000.0
    block_size: int = 4096
    tie_embeddings: bool = True
    qk_bias: bool = True
    bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = HUGINN_MODEL_TYPE
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    ARCHITECTURE = "RavenForCausalLM"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_heads:
            raise ModelLoadError(f"n_embd ({self.n_embd}) must be a multiple of n_heads")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if min(self.n_layers_in_prelude, self.n_layers_in_recurrent_block) < 1:
            raise ModelLoadError("Huginn needs at least one prelude and one core layer")
        if self.mean_recurrence < 1:
            raise ModelLoadError(f"mean_recurrence must be >= 1, got {self.mean_recurrence}")

    # The names the rest of loopserve reads from any family's config.
    hidden_size = property(lambda self: self.n_embd)
    num_attention_heads = property(lambda self: self.n_heads)
    num_key_value_heads = property(lambda self: self.n_heads)
    head_dim = property(lambda self: self.n_embd // self.n_heads)
    tie_word_embeddings = property(lambda self: self.tie_embeddings)

    @property
    def num_loops(self) -> int:
        """The default recurrence r (`mean_recurrence`); a request may ask for another."""
        return self.mean_recurrence

    max_position_embeddings = property(lambda self: self.block_size)
    num_core_layers = property(lambda self: self.n_layers_in_recurrent_block)

    def with_loops(self, num_loops: int) -> HuginnConfig:
        """The same model with default and largest r `num_loops` (`mean_recurrence`)."""
        return replace(self, mean_recurrence=num_loops)

    num_prelude_layers = property(lambda self: self.n_layers_in_prelude)
    num_coda_layers = property(lambda self: self.n_layers_in_coda)

    @property
    def step_extra_params(self) -> int:
        """Read once per step besides the core layers: the adapter over [state, e]."""
        return 2 * self.n_embd * self.n_embd + (self.n_embd if self.bias else 0)

    @property
    def exit_gate_params(self) -> int:
        return 0  # convergence criteria: no learned exit head

    @property
    def num_once_layers(self) -> int:
        """Layers with one K/V entry per position: prelude and coda."""
        return self.n_layers_in_prelude + self.n_layers_in_coda

    @property
    def layer_groups(self) -> dict[str, range]:
        """Global layer indices of each part, as the attention backend sees them."""
        p, c, k = self.n_layers_in_prelude, self.n_layers_in_recurrent_block, self.n_layers_in_coda
        return {"prelude": range(p), "core": range(p, p + c), "coda": range(p + c, p + c + k)}

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.n_embd)

    @property
    def init_std(self) -> float:
        return math.sqrt(2 / (5 * self.n_embd))

    @property
    def extra_kv_planes(self) -> int:
        """Planes every request holds beyond the layout's step planes: the prelude's and
        coda's K/V, one entry per position, in planes of the core's layer count
        (`once_kv_planes`; one for Huginn-0125's 2 + 2 layers beside its 4 core layers)."""
        return once_kv_planes(self.num_once_layers, self.num_core_layers)

    def kv_bytes_per_block(self, block_size: int, element_size: int) -> int:
        """Bytes of one K/V block of one plane: every plane has the core's layers (a step
        plane holds one step of them; the once planes hold the prelude and coda layers)."""
        layers = self.num_core_layers
        return 2 * layers * self.num_key_value_heads * self.head_dim * block_size * element_size

    def kv_elements_per_token(self, planes: int) -> int:
        """K and V elements one position stores with `planes` core planes."""
        layers = self.num_once_layers + planes * self.num_core_layers
        return 2 * layers * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> HuginnConfig:
        if raw.get("model_type") != HUGINN_MODEL_TYPE:
            raise ModelLoadError(
                f"config.json has model_type {raw.get('model_type')!r}, not {HUGINN_MODEL_TYPE!r}"
            )
        for key, value in _FIXED_CHOICES.items():
            if raw.get(key, value) != value:
                raise ModelLoadError(f"Huginn {key}={raw[key]!r} is not supported (only {value!r})")
        heads = raw.get("n_heads", raw.get("num_attention_heads"))
        if raw.get("num_key_value_heads", heads) != heads:
            raise ModelLoadError("Huginn checkpoints with grouped K/V heads are not supported")
        known = (
            "vocab_size", "n_embd", "intermediate_size", "n_layers_in_prelude",
            "n_layers_in_recurrent_block", "n_layers_in_coda", "mean_recurrence", "norm_eps",
            "rope_base", "block_size", "tie_embeddings", "qk_bias", "bias", "bos_token_id",
            "pad_token_id",
        )  # fmt: skip
        kwargs = {k: raw[k] for k in known if raw.get(k) is not None}
        kwargs["n_heads"] = heads
        kwargs.setdefault("n_embd", raw.get("hidden_size"))
        return cls._build(raw, known, kwargs)

    def _written(self, raw: dict) -> dict:
        raw["num_attention_heads"] = raw["num_key_value_heads"] = raw.pop("n_heads")
        raw["n_layers"] = self.num_once_layers + self.n_layers_in_recurrent_block
        return {**raw, **_FIXED_CHOICES}
