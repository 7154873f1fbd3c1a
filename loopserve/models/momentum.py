"""MomentumLoop: a third looped family, made to prove the family seam (no published weights).

No published looped model besides Ouro and Huginn-0125 had its authors' modelling code and a
config in reach of this project (docs/model_families.md says which were tried), so this
family is loopserve's own, small and seeded, built to differ from both in what the runner
must not care about:

- carried state: [h, m], the loop's hidden state and a running mean of the loop outputs
  (m starts at the embedding; each loop m <- (m + h) / 2), which the coda reads;
- exit signal: the model's confidence in its next token at this loop, the largest
  probability of the coda's distribution over m, read as the loop's hazard under the CDF
  rule (Ouro's is a trained gate over h; Huginn's a convergence criterion);
- prelude and coda: an embedding and an LM head over `norm(m)`, no attention of their own.

A loop is the core layers (pre-norm attention with rotate-half RoPE and a SiLU MLP) over h,
then `norm`. The math is all here (`LoopedModel` in `models/family.py`); the engine runs it
through the one executor with no code of its own. `models/momentum_tiny.py` writes a seeded
checkpoint for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional as F

from loopserve.errors import ModelLoadError
from loopserve.models.attention import AttentionBackend
from loopserve.models.config import ConfigFile
from loopserve.models.ouro import RMSNorm, apply_rope

MOMENTUM_MODEL_TYPE = "loopserve_momentum"


@dataclass(frozen=True)
class MomentumConfig(ConfigFile):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_core_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_loops: int = 4
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 256
    eos_token_id: tuple[int, ...] = ()
    model_type: str = MOMENTUM_MODEL_TYPE
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    ARCHITECTURE = "MomentumLoopForCausalLM"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ModelLoadError("heads must be a multiple of K/V heads and head_dim even")

    # The `LoopedConfig` names (models/family.py).
    head_dim = property(lambda self: self.hidden_size // self.num_attention_heads)
    tie_word_embeddings = property(lambda self: False)
    num_prelude_layers = property(lambda self: 0)
    num_coda_layers = property(lambda self: 0)
    extra_kv_planes = property(lambda self: 0)
    step_extra_params = property(lambda self: self.hidden_size)  # the loop's norm
    exit_gate_params = property(lambda self: 0)  # its signal is the coda's confidence

    def kv_bytes_per_block(self, block_size: int, element_size: int) -> int:
        per_position = 2 * self.num_core_layers * self.num_key_value_heads * self.head_dim
        return per_position * block_size * element_size

    def with_loops(self, num_loops: int) -> MomentumConfig:
        return replace(self, num_loops=num_loops)

    @classmethod
    def from_dict(cls, raw: dict) -> MomentumConfig:
        if raw.get("model_type") != MOMENTUM_MODEL_TYPE:
            raise ModelLoadError(f"config.json has model_type {raw.get('model_type')!r}")
        known = {f for f in cls.__dataclass_fields__ if f not in ("eos_token_id", "extra")}
        return cls._build(raw, known, {k: raw[k] for k in known if raw.get(k) is not None})


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [rows, head_dim] for rotate-half RoPE, in float32 from integer positions."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    freqs = positions.float().unsqueeze(1) / (theta**exponents).unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MomentumLayer(nn.Module):
    def __init__(self, config: MomentumConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.layer_idx, self.heads, self.kv_heads = (
            layer_idx,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        self.head_dim = config.head_dim
        self.attn_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv = nn.Linear(hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.act = nn.SiLU()

    def forward(self, h, cos, sin, attn: AttentionBackend) -> torch.Tensor:
        rows, d = h.shape[0], self.head_dim
        q, k, v = self.qkv(self.attn_norm(h)).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1
        )
        q = apply_rope(q.reshape(rows, self.heads, d), cos, sin)
        k = apply_rope(k.reshape(rows, self.kv_heads, d), cos, sin)
        out = attn.attend(self.layer_idx, q, k, v.reshape(rows, self.kv_heads, d))
        h = h + self.out(out.reshape(rows, self.heads * d))
        gate, up = self.up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(self.act(gate) * up)


class MomentumLoopLM(nn.Module):
    """The family's model and its math (`LoopedModel`)."""

    signal_kind = "hazard"
    leave_writes_kv = False

    def __init__(self, config: MomentumConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MomentumLayer(config, i) for i in range(config.num_core_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def num_loops(self) -> int:
        return self.config.num_loops

    state_width = property(lambda self: 2 * self.config.hidden_size)  # [h, m]
    kv_layers = property(lambda self: self.config.num_core_layers)

    def enter(self, token_ids, positions=None, once=(), initial=None) -> torch.Tensor:
        h = self.embed(token_ids)
        return torch.cat([h, h], dim=-1)

    def loop(self, carried, positions, attn) -> torch.Tensor:
        width = self.config.hidden_size
        h, m = carried[:, :width], carried[:, width:]
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        h = self.norm(h)
        return torch.cat([h, (m + h) * 0.5], dim=-1)

    def latent(self, carried: torch.Tensor) -> torch.Tensor:
        return carried[:, self.config.hidden_size :]

    def leave(self, carried, positions=None, once=()) -> torch.Tensor:
        return self.lm_head(self.out_norm(self.latent(carried)))

    def hazard_fn(
        self, lookahead_seed: int | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Confidence as the hazard: the largest next-token probability at this loop, [rows]
        float32 (it has no lookahead head: `random_lookahead` is not among its exit modes)."""
        return lambda carried: F.softmax(self.leave(carried).float(), dim=-1).amax(dim=-1)

    def make_rows_invariant(self) -> None:
        """Nothing beyond the linears and SiLUs the runner converts."""

    def profile_forward(self, token_ids, positions, attn) -> torch.Tensor:
        return self.leave(self.loop(self.enter(token_ids), positions, attn))
