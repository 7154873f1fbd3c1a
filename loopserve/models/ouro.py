"""The Ouro looped transformer, split into prelude / core / gate / coda.

Math follows Hugging Face `modeling_ouro.py` exactly: four RMSNorms per layer,
`model.norm` after every loop (its output is the loop output, the gate input and the next
loop's input), RoPE rotate-half on the token position, untied `lm_head`.

The core runs ONE loop over a flat batch of rows; each row carries its own position. Depth
matters only for K/V, which the `AttentionBackend` argument owns, so one core call can mix
rows of different requests and depths. This module never schedules and never stores K/V.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from loopserve.models.attention import AttentionBackend, attend_projected, attend_qkv
from loopserve.models.config import OuroConfig
from loopserve.models.family import table_positions


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * hidden.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, computed in float32 from integer positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # Computed on the host, then placed on the default device; on the meta device (the
        # loader builds there) the table stays a real one on the host, which `load_model`
        # moves to the model's device (meta arithmetic would import torch._dynamo).
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
        inv_freq = 1.0 / (theta ** (exponents.to(torch.float32) / head_dim))
        default = torch.get_default_device()
        if default.type != "meta":
            inv_freq = inv_freq.to(default)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)  # [rows, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim]; cos/sin [rows, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        # q, k and v as one GEMM (`merge_projections`): their weights are views of this (a
        # buffer, so dtype and device moves take it along; not a checkpoint tensor).
        self.qkv_weight: torch.Tensor | None
        self.register_buffer("qkv_weight", None, persistent=False)
        # The runner's fused rotary over the merged projection (`use_fused_ops`): None, torch.
        self.rope_qkv: Callable | None = None

    def merge_projections(self) -> None:
        self.qkv_weight = _merge(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        layer_idx: int,
    ) -> torch.Tensor:
        rows = hidden.shape[0]
        if self.qkv_weight is not None and self.rope_qkv is not None:
            rotate = functools.partial(self.rope_qkv, cos=cos, sin=sin,
                                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)  # fmt: skip
            out = attend_qkv(attn, layer_idx, F.linear(hidden, self.qkv_weight), rotate)
            return self.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
        if self.qkv_weight is not None:
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = F.linear(hidden, self.qkv_weight).split(
                (self.num_heads * self.head_dim, kv_width, kv_width), dim=-1
            )
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        query = q.view(rows, self.num_heads, self.head_dim)
        key = k.view(rows, self.num_kv_heads, self.head_dim)
        value = v.view(rows, self.num_kv_heads, self.head_dim)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        out = attn.attend(layer_idx, query, key, value)  # [rows, Hq, Dh]
        return self.o_proj(out.reshape(rows, self.num_heads * self.head_dim))


class OuroMLP(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = nn.SiLU()  # a module (no weights), so an execution mode may swap it
        self.gate_up_weight: torch.Tensor | None  # `merge_projections`
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.silu_mul: Callable | None = None  # the runner's fused kernel (`use_fused_ops`)

    def merge_projections(self) -> None:
        self.gate_up_weight = _merge(self.gate_proj, self.up_proj)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None and self.silu_mul is not None:
            return self.down_proj(self.silu_mul(F.linear(hidden, self.gate_up_weight)))
        if self.gate_up_weight is not None:
            gate, up = F.linear(hidden, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(hidden), self.up_proj(hidden)
        return self.down_proj(self.act_fn(gate) * up)


def _merge(*linears: nn.Linear) -> torch.Tensor:
    """One weight for several bias-free linears of the same input, their outputs side by side;
    each linear's weight becomes a view of it (same names, no second copy)."""
    with torch.no_grad():
        merged = torch.cat([linear.weight for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(merged[start : start + rows], requires_grad=False)
        start += rows
    return merged


class OuroDecoderLayer(nn.Module):
    def __init__(self, config: OuroConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.layer_idx = layer_idx
        self.self_attn = OuroAttention(config)
        self.mlp = OuroMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, attn, self.layer_idx)
        hidden = hidden + self.input_layernorm_2(attn_out)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + self.post_attention_layernorm_2(mlp_out)

    def forward_fused(
        self,
        hidden: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        next_norm: RMSNorm,
        add_norm_norm: Callable,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with each residual add and the two norms around it in one call
        (`add_norm_norm`): takes the residual and its `input_layernorm`, returns the new
        residual and its `next_norm` (the next layer's input norm, or the final norm)."""
        attn_out = self.self_attn(normed, cos, sin, attn, self.layer_idx)
        hidden, normed = add_norm_norm(
            hidden, attn_out, self.input_layernorm_2, self.post_attention_layernorm
        )
        mlp_out = self.mlp(normed)
        return add_norm_norm(hidden, mlp_out, self.post_attention_layernorm_2, next_norm)

    def forward_fused_linear(
        self,
        hidden: torch.Tensor,
        branch: torch.Tensor | None,
        branch_norm: RMSNorm | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        attn: AttentionBackend,
        linear: Callable,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` in five launches (`fused_linear`, runner/fused_linear.py), the residual
        add of the previous layer's MLP branch deferred into this layer's first GEMM: takes
        the residual and that branch (None for a loop's first layer) with its norm, returns
        the new residual and this layer's MLP branch (its `post_attention_layernorm_2` still
        to apply). `rope`: cos/sin tables over every position (`use_fused_linears`)."""
        attn_mod, mlp = self.self_attn, self.mlp
        # residual + branch_norm(branch), input_layernorm, q/k/v, rotary, K/V write.
        project = functools.partial(
            linear, branch, attn_mod.qkv_weight, residual=hidden, norm_a=branch_norm,
            norm_b=self.input_layernorm, rope=(*rope, attn_mod.num_heads, attn_mod.num_kv_heads),
            positions=positions,
        )  # fmt: skip
        out, hidden = attend_projected(attn, self.layer_idx, project)
        attn_out = attn_mod.o_proj(out.reshape(out.shape[0], -1))
        gate_up, hidden = linear(
            attn_out, mlp.gate_up_weight, residual=hidden, norm_a=self.input_layernorm_2,
            norm_b=self.post_attention_layernorm,
        )  # fmt: skip
        return hidden, linear(gate_up, mlp.down_proj.weight, silu=True)


class OuroBackbone(nn.Module):
    """Holds the checkpoint's `model.*` tensors."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            OuroDecoderLayer(config, idx) for idx in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)


class OuroForLoopedLM(nn.Module):
    """Ouro with a per-loop API. Parameter names equal the Hugging Face checkpoint's."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OuroBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # The runner's fused residual-add + norms (`use_fused_norms`); None: torch ops.
        self.add_norm_norm: Callable | None = None
        # The runner's GEMMs with fused neighbours (`use_fused_linears`) and the most rows
        # they take; None: the GEMMs above.
        self.fused_linear: Callable | None = None
        self.fused_linear_rows = 0
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin

    @property
    def num_loops(self) -> int:
        return self.config.total_ut_steps

    # ---- the looped-model math (`models/family.py`, `LoopedModel`) -------------------------
    # Ouro carries the hidden state from loop to loop, keeps K/V only per loop plane, reads a
    # hazard, and its enter and leave are an embedding and the LM head (no K/V of their own).
    signal_kind = "hazard"
    leave_writes_kv = False

    state_width = property(lambda self: self.config.hidden_size)
    kv_layers = property(lambda self: self.config.num_hidden_layers)

    def enter(self, token_ids, positions=None, once=(), initial=None) -> torch.Tensor:
        return self.prelude(token_ids)

    def loop(self, carried, positions, attn) -> torch.Tensor:
        return self.core(carried, positions, attn)

    def latent(self, carried: torch.Tensor) -> torch.Tensor:
        return carried

    def leave(self, carried, positions=None, once=()) -> torch.Tensor:
        return self.coda(carried)

    def merge_projections(self) -> None:
        """q/k/v as one GEMM and gate/up as one, per layer (the loader's last step on CUDA;
        the checkpoint keeps its published names, whose weights become views of the merged
        ones): 4 GEMMs per layer instead of 7."""
        for layer in self.model.layers:
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()

    def use_fused_norms(self, add_norm_norm: Callable | None) -> None:
        """Run each layer's residual adds and norms through `add_norm_norm(residual, branch,
        norm_a, norm_b) -> (residual + norm_a(branch), norm_b(that))` (the runner's fused
        kernel, `runner/fused_norms.py`; a branch of None normalizes the residual alone):
        2 calls per layer instead of 4 RMSNorms and 2 adds. None: back to torch ops."""
        self.add_norm_norm = add_norm_norm

    def use_fused_ops(self, rope_qkv: Callable | None, silu_mul: Callable | None) -> None:
        """Run each layer's rotary embedding (`rope_qkv(qkv, cos, sin, Hq, Hkv) -> q, k, v`)
        and SiLU-and-multiply (`silu_mul(gate_up)`) as one kernel each (the runner's,
        `runner/fused_ops.py`), over the merged projections (`merge_projections`; without
        them the torch ops run). None: back to torch ops."""
        for layer in self.model.layers:
            layer.self_attn.rope_qkv = rope_qkv
            layer.mlp.silu_mul = silu_mul

    def use_fused_linears(
        self, fused_linear: Callable | None, max_rows: int = 0, max_positions: int | None = None
    ) -> None:
        """Run core calls of up to `max_rows` rows through `fused_linear` (the runner's,
        `runner/fused_linear.py`): each layer in 5 launches (`forward_fused_linear`). Needs
        the merged projections and the fused norms; None: back to them. The rotary's cos/sin
        tables are computed here for every position (the same operations as per call), so
        a loop launches no table kernels: the fused GEMM reads each row's by its position.
        `max_positions`: the engine's length bound (None: the model's)."""
        self.fused_linear, self.fused_linear_rows = fused_linear, max_rows
        self._rope_tables = None
        if fused_linear is not None:
            param = self.lm_head.weight
            every = torch.arange(table_positions(self.config, max_positions), device=param.device)
            self._rope_tables = self.rotary(every, param.dtype)

    def rope_table_bytes(self, max_positions: int | None) -> int:
        """Device bytes of the cos/sin tables `use_fused_linears` keeps (the memory plan
        reserves them): two [positions, head_dim] tables in the model's dtype."""
        element = self.lm_head.weight.element_size()
        return 2 * table_positions(self.config, max_positions) * self.config.head_dim * element

    def make_rows_invariant(self) -> None:
        """Back to one linear per projection: the runner made those row by row (a merged
        GEMM would bypass them)."""
        for layer in self.model.layers:
            layer.self_attn.qkv_weight = None
            layer.mlp.gate_up_weight = None

    def hazard_fn(
        self, lookahead_seed: int | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Its exit signal over carried rows: the trained gate, or the `random_lookahead`
        mode's seeded head (`make_hazard_fn`)."""
        return make_hazard_fn(self, lookahead_seed=lookahead_seed)

    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [rows] -> hidden [rows, hidden]."""
        return self.model.embed_tokens(token_ids)

    def core(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """One loop over every layer, then `model.norm`. hidden [rows, hidden] -> same."""
        layers, fused = self.model.layers, self.add_norm_norm
        if fused is not None and self._fuses_linears(hidden.shape[0]):
            branch, branch_norm = None, None
            for layer in layers:
                hidden, branch = layer.forward_fused_linear(
                    hidden, branch, branch_norm, self._rope_tables, positions, attn,
                    self.fused_linear,
                )  # fmt: skip
                branch_norm = layer.post_attention_layernorm_2
            return fused(hidden, branch, branch_norm, self.model.norm)[1]
        cos, sin = self.rotary(positions, hidden.dtype)
        if fused is not None:
            normed = fused(hidden, None, None, layers[0].input_layernorm)[1]
            norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
            for layer, next_norm in zip(layers, norms):
                hidden, normed = layer.forward_fused(
                    hidden, normed, cos, sin, attn, next_norm, fused
                )
            return normed
        for layer in layers:
            hidden = layer(hidden, cos, sin, attn)
        return self.model.norm(hidden)

    def _fuses_linears(self, rows: int) -> bool:
        first = self.model.layers[0]
        return (
            self.fused_linear is not None
            and 0 < rows <= self.fused_linear_rows
            and first.self_attn.qkv_weight is not None
            and first.mlp.gate_up_weight is not None
            and first.self_attn.rope_qkv is not None
        )

    def gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exit hazard λ = sigmoid(early_exit_gate(h)) of normed loop outputs, [rows] float32
        for every model dtype (`float32_hazards`)."""
        return float32_hazards(self.model.early_exit_gate, hidden)

    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on the exit loop's normed state. [rows, vocab]."""
        return self.lm_head(hidden)

    def profile_forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Every part of one loop over `token_ids` [rows]: prelude, core, gate, coda (the
        memory plan's activation peak, `LoopedModel`). [rows, vocab]."""
        hidden = self.core(self.prelude(token_ids), positions, attn)
        self.gate(hidden)
        return self.coda(hidden)


def float32_hazards(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """sigmoid(head(hidden)) [rows] computed in float32 whatever the model dtype: a bf16 gate
    rounds each hazard to 8 bits before the exit CDF sums them, which moves exit depths more
    than the bf16 hidden state itself does. The head is one row of weights: the casts cost
    nothing next to the core."""
    bias = None if head.bias is None else head.bias.float()
    logits = F.linear(hidden.float(), head.weight.float(), bias)
    return torch.sigmoid(logits.squeeze(-1))


def make_lookahead_head(model: OuroForLoopedLM, seed: int) -> nn.Linear:
    """The seeded, untrained hazard head of the `random_lookahead` exit mode.

    Not a checkpoint tensor: whoever needs it builds its own from the seed, so two callers
    with the same seed get identical weights. Use as `torch.sigmoid(head(h).squeeze(-1))`.
    """
    generator = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    head = nn.Linear(hidden, 1)
    with torch.no_grad():
        # Scaled so sigmoid outputs spread over (0, 1) for unit-RMS inputs.
        head.weight.copy_(torch.randn(1, hidden, generator=generator) * (2.0 / hidden**0.5))
        head.bias.copy_(torch.randn(1, generator=generator))
    param = model.lm_head.weight
    return head.to(device=param.device, dtype=param.dtype).requires_grad_(False)


def make_hazard_fn(
    model: OuroForLoopedLM, *, lookahead_seed: int | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [rows, hidden] -> hazards [rows]: the trained gate, or the lookahead head."""
    if lookahead_seed is None:
        return model.gate
    head = make_lookahead_head(model, lookahead_seed)
    return lambda hidden: float32_hazards(head, hidden)
