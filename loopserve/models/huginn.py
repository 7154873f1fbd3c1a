"""Huginn-0125 (tomg-group-umd), the second looped family: prelude, a recurrent core with
input injection run r times, coda.

Math follows the authors' `raven_modeling_minimal.py`:
- the embedding is scaled by sqrt(n_embd); every layer is a "sandwich" block: RMSNorm before
  the sublayer and again after the residual add (`norm_2(attn(norm_1(x)) + x)`, then
  `norm_4(mlp(norm_3(x)) + x)`);
- attention has one fused `Wqkv`, a learned per-head bias on q and k before RoPE, RoPE on
  interleaved pairs (GPT-J style, base 50,000) computed in float32, no GQA by default;
- the MLP is one `fc` producing both halves: `proj(silu(a) * b)`;
- a core step is `adapter(cat([state, e]))` then the core layers, where `e` is the prelude's
  output for the same position (input injection at every step);
- the coda reads `ln_f(state)`, runs its layers and `ln_f` again before the LM head;
- the initial state is truncated-normal noise scaled by sqrt(n_embd), or zeros at
  `init_scale=0`.

Rows are flat ([rows, hidden]) and carry their own positions, as for Ouro. K/V belongs to the
`AttentionBackend` argument. Layer indices are global: prelude layers first, then the core
layers, then the coda layers (`HuginnConfig.layer_groups`). Prelude and coda layers keep one
K/V entry per position; core layers keep one per position and recurrence step.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from loopserve.models.attention import AttentionBackend, attend_projected, attend_qkv
from loopserve.models.config import once_layer_slot
from loopserve.models.family import table_positions
from loopserve.models.huginn_config import HuginnConfig


class HuginnRMSNorm(nn.Module):
    """Normalizes in float32, casts back, then scales (the authors' order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_inverse_frequencies(head_dim: int, base: float, device) -> torch.Tensor:
    """The interleaved rotary's inverse frequencies [head_dim / 2], float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (base ** (exponents / head_dim))


def interleaved_rope_tables(
    positions: torch.Tensor, head_dim: int, base: float, inv_freq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [rows, head_dim / 2] in float32 for pairs (2i, 2i+1); `inv_freq`: the
    `rope_inverse_frequencies` on the positions' device, computed here when not given."""
    if inv_freq is None:
        inv_freq = rope_inverse_frequencies(head_dim, base, positions.device)
    freqs = positions.to(torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
    return torch.cos(freqs), torch.sin(freqs)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim]; rotates each pair (x[2i], x[2i+1]) in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return rotated.flatten(-2).type_as(x)


class HuginnAttention(nn.Module):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.num_heads = config.n_heads
        self.head_dim = config.head_dim
        self.Wqkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim))
        else:
            self.qk_bias = None
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.rope_qkv = None  # the runner's fused rotary (`use_fused_ops`); None: torch ops

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        layer_idx: int,
    ) -> torch.Tensor:
        rows = x.shape[0]
        if self.rope_qkv is not None:
            bias = None if self.qk_bias is None else self.qk_bias.view(2, *self.qk_bias.shape[2:])
            rotate = functools.partial(
                self.rope_qkv, cos=rope[0], sin=rope[1], num_heads=self.num_heads,
                num_kv_heads=self.num_heads, interleaved=True, bias=bias,
            )  # fmt: skip
            out = attend_qkv(attn, layer_idx, self.Wqkv(x), rotate)
            return self.proj(out.reshape(rows, self.num_heads * self.head_dim))
        shape = (rows, self.num_heads, self.head_dim)
        query, key, value = (part.reshape(shape) for part in self.Wqkv(x).chunk(3, dim=-1))
        if self.qk_bias is not None:
            query = (query + self.qk_bias[0, 0]).to(query.dtype)
            key = (key + self.qk_bias[1, 0]).to(query.dtype)
        query, key = apply_interleaved_rope(query, *rope), apply_interleaved_rope(key, *rope)
        out = attn.attend(layer_idx, query, key, value)
        return self.proj(out.reshape(rows, self.num_heads * self.head_dim))


class HuginnMLP(nn.Module):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)
        self.nonlin = nn.SiLU()
        self.silu_mul = None  # the runner's fused kernel (`use_fused_ops`); None: torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul is not None:
            return self.proj(self.silu_mul(self.fc(x)))
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(self.nonlin(gate) * up)


class SandwichBlock(nn.Module):
    def __init__(self, config: HuginnConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.norm_eps
        self.layer_idx = layer_idx
        self.norm_1 = HuginnRMSNorm(config.n_embd, eps)
        self.attn = HuginnAttention(config)
        self.norm_2 = HuginnRMSNorm(config.n_embd, eps)
        self.mlp = HuginnMLP(config)
        self.norm_3 = HuginnRMSNorm(config.n_embd, eps)
        self.norm_4 = HuginnRMSNorm(config.n_embd, eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend
    ) -> torch.Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), rope, attn, self.layer_idx) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)

    def forward_fused_linear(
        self,
        x: torch.Tensor,
        branch: torch.Tensor | None,
        branch_norm: HuginnRMSNorm | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        attn: AttentionBackend,
        linear,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` in five launches (`fused_linear`, runner/fused_linear.py), the previous
        block's last sandwich norm deferred into this block's first GEMM: takes the residual
        and that block's MLP branch (None for a step's first block) with its `norm_4`,
        returns the new residual and this block's MLP branch (`norm_4(branch + residual)`
        still to apply). `rope`: cos/sin tables over every position (`use_fused_linears`)."""
        attn_mod, mlp = self.attn, self.mlp
        heads = attn_mod.num_heads
        bias = attn_mod.qk_bias
        # norm_4'(branch + x), norm_1, Wqkv, the q/k bias, interleaved rotary, K/V write.
        project = functools.partial(
            linear, branch, attn_mod.Wqkv.weight, residual=x, norm_a=branch_norm,
            norm_b=self.norm_1, norm_sum=True, rope=(*rope, heads, heads), interleaved=True,
            bias=None if bias is None else bias.view(2, heads, attn_mod.head_dim),
            positions=positions,
        )  # fmt: skip
        out, x = attend_projected(attn, self.layer_idx, project)
        attn_out = attn_mod.proj(out.reshape(out.shape[0], -1))
        fc, x = linear(attn_out, mlp.fc.weight, residual=x, norm_a=self.norm_2,
                       norm_b=self.norm_3, norm_sum=True)  # fmt: skip
        return x, linear(fc, mlp.proj.weight, silu=True)


class HuginnTransformer(nn.Module):
    """Holds the checkpoint's `transformer.*` tensors."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        groups = config.layer_groups
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.prelude = nn.ModuleList(SandwichBlock(config, i) for i in groups["prelude"])
        self.adapter = nn.Linear(2 * config.n_embd, config.n_embd, bias=config.bias)
        self.core_block = nn.ModuleList(SandwichBlock(config, i) for i in groups["core"])
        self.coda = nn.ModuleList(SandwichBlock(config, i) for i in groups["coda"])
        self.ln_f = HuginnRMSNorm(config.n_embd, config.norm_eps)


class HuginnForLoopedLM(nn.Module):
    """Huginn with a per-step API. Parameter names equal the published checkpoint's."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = HuginnTransformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # The runner's fused residual-add + norms (`use_fused_norms`); None: torch ops.
        self.add_norm_norm = None
        self.fused_linear = None  # `use_fused_linears`, with the most rows it takes
        self.fused_linear_rows = 0
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # `rope`'s, per device

    @property
    def num_loops(self) -> int:
        return self.config.mean_recurrence

    # ---- the looped-model math (`models/family.py`, `LoopedModel`) -------------------------
    # Huginn carries [state, e] (the recurrent state and the prelude output injected at every
    # step), keeps its prelude's and coda's K/V once per position (the once planes), reads a
    # convergence criterion (`exit/criteria.py`) and its coda writes K/V: it runs for every
    # position that completes, not only for the rows that sample.
    signal_kind = "criterion"
    leave_writes_kv = True

    state_width = property(lambda self: 2 * self.config.n_embd)  # [state, e]
    kv_layers = property(lambda self: self.config.num_core_layers)

    def enter(self, token_ids, positions, once, initial=None) -> torch.Tensor:
        """[initial state, e] of the rows: e from the prelude (its layers' K/V into the once
        planes, `once`); the state is `initial` or zeros."""
        e = self.prelude(token_ids, positions, LayerRouter(self.config.layer_groups, once=once))
        state = self.initial_state(e, init_scale=0.0) if initial is None else initial
        return torch.cat([state.to(device=e.device, dtype=e.dtype), e], dim=-1)

    def loop(self, carried, positions, attn) -> torch.Tensor:
        router = LayerRouter(self.config.layer_groups, core=attn)
        e = carried[:, self.config.n_embd :]
        return torch.cat([self._step(carried, positions, router), e], dim=-1)

    def latent(self, carried: torch.Tensor) -> torch.Tensor:
        return carried[:, : self.config.n_embd]

    def leave(self, carried, positions, once) -> torch.Tensor:
        router = LayerRouter(self.config.layer_groups, once=once)
        return self.coda(self.latent(carried), positions, router)

    def use_fused_norms(self, add_norm_norm) -> None:
        """Run the core blocks' residual adds and norms through `add_norm_norm(residual,
        branch, norm_a, norm_b, norm_sum=True) -> (norm_a(branch + residual), norm_b(that))`
        (the runner's fused kernel, `runner/fused_norms.py`): 2 calls per block instead of 4
        norms and 2 adds. None: back to torch ops. The prelude and coda (once per token)
        keep the torch ops."""
        self.add_norm_norm = add_norm_norm

    def use_fused_ops(self, rope_qkv, silu_mul) -> None:
        """Run every attention block's interleaved rotary embedding (with its q/k bias) and
        every MLP's SiLU-and-multiply as one kernel each (`runner/fused_ops.py`), in the
        prelude, the core and the coda. None: back to torch ops."""
        for block in self.transformer.modules():
            if isinstance(block, HuginnAttention):
                block.rope_qkv = rope_qkv
            elif isinstance(block, HuginnMLP):
                block.silu_mul = silu_mul

    def use_fused_linears(
        self, fused_linear, max_rows: int = 0, max_positions: int | None = None
    ) -> None:
        """Run calls of up to `max_rows` rows through `fused_linear` (the runner's,
        `runner/fused_linear.py`): each block, the prelude's and coda's too, in 5 launches
        (`forward_fused_linear`). Needs the fused norms and rotary; None: back to them. The
        rotary's cos/sin tables are computed here for every
        position (`rope`'s operations) up to `max_positions` (the engine's length bound;
        None: the model's), so a step launches no table kernels."""
        self.fused_linear, self.fused_linear_rows = fused_linear, max_rows
        self._rope_tables = None
        if fused_linear is not None:
            device = self.lm_head.weight.device
            positions = torch.arange(table_positions(self.config, max_positions), device=device)
            self._rope_tables = self.rope(positions)

    def rope_table_bytes(self, max_positions: int | None) -> int:
        """Device bytes of the cos/sin tables `use_fused_linears` keeps (the memory plan
        reserves them): two [positions, head_dim / 2] tables in float32."""
        return 2 * table_positions(self.config, max_positions) * (self.config.head_dim // 2) * 4

    def _fuses_linears(self, rows: int) -> bool:
        first = self.transformer.core_block[0]
        return (
            self.fused_linear is not None
            and 0 < rows <= self.fused_linear_rows
            and first.attn.rope_qkv is not None
        )

    def make_rows_invariant(self) -> None:
        """Its RoPE tables one row at a time (after the runner made its linears and SiLUs
        row by row). The tables are a guard, not a measured fix: cos/sin over [rows,
        head_dim / 2] are elementwise transcendental calls like SiLU, whose vector/scalar
        split moves with the row count on some CPUs; on this project's AMD EPYC (AVX-512)
        host they measured row-invariant at head_dim 8, 96 and 128. Everything else Huginn
        runs is row-invariant as it is (RMSNorm's sqrt and division round exactly in either
        code; softmax and the criteria reduce per row), which
        tests/test_huginn_batch_invariant.py checks bit for bit."""
        tables = self.rope

        def rope_row_by_row(positions: torch.Tensor):
            if positions.shape[0] == 0:
                return tables(positions)
            rows = [tables(positions[i : i + 1]) for i in range(positions.shape[0])]
            return torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])

        self.rope = rope_row_by_row

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of `positions`. The inverse frequencies are computed once per device (the
        same operations, so the same values) rather than in every call: 5 kernels fewer in
        every prelude, core step and coda, which a graphed loop replays once per step."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            config = self.config
            inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_base, positions.device)
            self._inv_freq[positions.device] = inv_freq
        return interleaved_rope_tables(
            positions, self.config.head_dim, self.config.rope_base, inv_freq
        )

    def prelude(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """token_ids [rows] -> e [rows, hidden]: scaled embedding through the prelude layers.
        `e` is injected into every core step of the same position."""
        x = self.transformer.wte(token_ids) * self.config.embed_scale
        return self._blocks(x, self.transformer.prelude, positions, attn)

    def initial_state(
        self, e: torch.Tensor, *, init_scale: float = 1.0, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The state before the first step, drawn as the authors draw it: normal noise (then
        overwritten by truncated normal noise, which is what consumes the generator twice),
        times sqrt(n_embd); zeros at `init_scale=0`. `generator` None uses the global RNG."""
        std = self.config.init_std * init_scale
        if std <= 0:
            return torch.zeros_like(e)
        x = torch.empty_like(e).normal_(generator=generator)
        nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
        return x * self.config.embed_scale

    def core(
        self,
        state: torch.Tensor,
        e: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """One recurrence step: adapter over [state, e], then the core layers. Returns the new
        (un-normed) state; the coda and the latent exit criteria read it."""
        return self._step(torch.cat([state, e.to(state.device)], dim=-1), positions, attn)

    def _step(self, carried: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """`core` from the rows' [state, e] as one tensor (the carried state the runner
        keeps): the adapter reads it as it is, no concatenation."""
        x = self.transformer.adapter(carried.contiguous())
        return self._blocks(x, self.transformer.core_block, positions, attn)

    def _blocks(
        self, x: torch.Tensor, blocks, positions: torch.Tensor, attn, last_norm=None
    ) -> torch.Tensor:
        """`x` through a group of sandwich blocks (prelude, core or coda), then `last_norm`
        when given (the coda's `ln_f`): in five launches a block with `fused_linears` (calls
        of few rows), with the fused norms (each residual add and the norms around it in one
        kernel, `last_norm` in the last), or block by block."""
        fused = self.add_norm_norm
        if not blocks:
            return x if last_norm is None else last_norm(x)
        if fused is not None and self._fuses_linears(x.shape[0]):
            branch, branch_norm = None, None
            for block in blocks:
                x, branch = block.forward_fused_linear(
                    x, branch, branch_norm, self._rope_tables, positions, attn, self.fused_linear
                )
                branch_norm = block.norm_4
            x, normed = fused(x, branch, branch_norm, last_norm, norm_sum=True)
            return x if last_norm is None else normed
        rope = self.rope(positions)
        if fused is None:
            for block in blocks:
                x = block(x, rope, attn)
            return x if last_norm is None else last_norm(x)
        normed = fused(x, None, None, blocks[0].norm_1)[1]
        nexts = [block.norm_1 for block in blocks[1:]] + [last_norm]
        for block, next_norm in zip(blocks, nexts):
            out = block.attn(normed, rope, attn, block.layer_idx)
            x, normed = fused(x, out, block.norm_2, block.norm_3, norm_sum=True)
            x, normed = fused(x, block.mlp(normed), block.norm_4, next_norm, norm_sum=True)
        return x if last_norm is None else normed

    def profile_forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Every part of one step over `token_ids` [rows]: prelude, one core step from the
        zero state, coda (the memory plan's activation peak, `LoopedModel`). [rows, vocab]."""
        e = self.prelude(token_ids, positions, attn)
        state = self.core(self.initial_state(e, init_scale=0.0), e, positions, attn)
        return self.coda(state, positions, attn)

    def coda(
        self, state: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """ln_f(state) -> coda layers -> ln_f -> LM head: logits [rows, vocab] in float32."""
        ln_f, fused = self.transformer.ln_f, self.add_norm_norm
        x = ln_f(state) if fused is None else fused(state, None, None, ln_f)[1]
        x = self._blocks(x, self.transformer.coda, positions, attn, last_norm=ln_f)
        return self.lm_head(x).float()


class LayerRouter:
    """The attention a Huginn call hands its layers: core layers go to the rows' step plane
    (`core`), prelude and coda layers to their once planes (`once`: one prepared call per
    once plane; the i-th prelude-or-coda layer is layer i % L of once plane i // L, where L
    is the core's layer count, `once_layer_slot`)."""

    def __init__(self, groups: dict[str, range], core=None, once=()) -> None:
        self.core, self.once = core, once
        self.core_start = groups["core"].start
        self.core_layers = groups["core"]
        prelude, coda = groups["prelude"], groups["coda"]
        per_plane = len(self.core_layers)
        self.once_slot = {
            layer: once_layer_slot(i, per_plane) for i, layer in enumerate([*prelude, *coda])
        }

    def _route(self, layer_idx: int):
        """(backend, its layer index) for model layer `layer_idx`."""
        if layer_idx in self.core_layers:
            return self.core, layer_idx - self.core_start
        plane, layer = self.once_slot[layer_idx]
        return self.once[plane], layer

    def attend(self, layer_idx: int, query, key, value):
        backend, layer = self._route(layer_idx)
        return backend.attend(layer, query, key, value)

    def attend_rotated(self, layer_idx: int, qkv, rotate):
        backend, layer = self._route(layer_idx)
        return attend_qkv(backend, layer, qkv, rotate)
