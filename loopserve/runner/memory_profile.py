"""The CUDA memory plan: profile what the engine needs before the KV cache is sized.

`profile_cuda_peak` runs, with the weights loaded and no KV cache yet, one dummy pass of
every part of the model (`LoopedModel.profile_forward`: Ouro's embedding, core loop, gate
and lm_head; Huginn's prelude, core step and coda) over `max_num_batched_tokens` rows (a
single causal sequence, attention on the rows themselves) and reads torch's allocator peak; memory outside torch's allocator
(CUDA context, cuBLAS workspaces) is `used by the device - reserved by torch`. The torch
attention backend's prompt-chunk scores (`[heads, chunk, context]` in float32, up to
`max_model_len` context) are added analytically, since the dummy sequence has no cached
context. `graph_pool_bytes` estimates the CUDA graphs' private pool (captured after the KV
cache exists, so it cannot be measured first): one forward at the largest bucket
(`max_num_seqs` rows), plus, for the torch attention backend only, the gather workspace of
that bucket over the graphs' context bound (`min(max_model_len, GRAPH_MAX_CONTEXT)`), and
the outputs and logits every bucket's forms keep as static outputs (`graph_outputs_bytes`). The
Triton backend (`paged_attention=True`) keeps scores and K/V tiles inside its kernels, so
neither the prompt-chunk scores nor a gather workspace is added for it. The sampler's
batched workspace (`sampling_workspace_bytes`: `max_num_seqs` rows of the vocabulary) comes
after the forward's activations are freed, so the activation peak is the larger of the two.
`loopserve.config.cuda_kv_budget` turns these into the KV byte budget (pure arithmetic,
unit-tested on CPU). Every function here but `dummy_forward` and `graph_outputs_bytes` needs
CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.models.family import LoopedModel
from loopserve.runner.graph_buffers import GRAPH_MAX_CONTEXT, graph_buckets

# Sampling on CUDA filters a call's rows as one batch (`runner/sampler.py`), so its workspace
# grows with the rows: at its peak (top-k, then top-p) `filtered_probs` holds, per logit,
# the scaled logits (4 bytes), the sort's values (4) and order (int64, 8), the sorted
# probabilities (4), their cumulative sums and the mass before each (4 + 4), three masks
# (1 each) and the filtered logits and probabilities (4 + 4): 39 bytes, plus a float32 copy
# of bf16 logits (4). Batched penalties need less (stacked counts, prompt mask, bias and
# their arithmetic: about 30).
SAMPLING_BYTES_PER_LOGIT = 44


def sampling_workspace_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The batched sampler's peak workspace for a call of `max_num_seqs` sampled rows."""
    return max_num_seqs * vocab_size * SAMPLING_BYTES_PER_LOGIT


class _SelfAttention:
    """Attention backend of the dummy forward: the rows are one causal sequence, no KV."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def attend(self, layer_idx, query, key, value) -> torch.Tensor:
        # [1, heads, rows, Dh]: 4-D inputs let SDPA take its fused (flash / memory-efficient)
        # kernels; 3-D ones take the math path, which materialises [heads, rows, rows] fp32
        # scores (17 GB at 16,384 rows) and would inflate the measured peak.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        return out.squeeze(0).transpose(0, 1)


@dataclass(frozen=True, slots=True)
class CudaMemoryProfile:
    total_bytes: int
    peak_bytes: int  # weights + activation peak + non-torch memory + chunk-attention scores
    graph_bytes: int  # estimate of the CUDA graphs' pool (0 when graphs are off)


def graph_outputs_bytes(
    max_num_seqs: int,
    *,
    state_width: int,
    vocab_size: int,
    element: int,
    num_forms: int,
    num_leave_forms: int,
) -> int:
    """What the captured decode steps keep as static outputs, all alive together in the
    graphs' pool (beyond the one forward the pool estimate prices): every bucket's every form
    holds its rows' outputs `[bucket, state_width]`, and each form with the leave its logits
    `[bucket, vocab]` for the coda. The engine passes the most forms a family's step takes
    (`DecodeGraphs.forms`: 2 and 1 with the leave; with once planes 4 and 2), an upper
    bound where an exit mode captures fewer."""
    per_row = num_forms * state_width + num_leave_forms * vocab_size
    return sum(graph_buckets(max_num_seqs)) * per_row * element


def dummy_forward(model: LoopedModel, rows: int, device: torch.device) -> torch.Tensor:
    """One pass of every part of `model` over `rows` dummy rows, one causal sequence
    attending to itself (`LoopedModel.profile_forward`): [rows, vocab] logits. Runs on any
    device; `_forward_peak` measures it on CUDA."""
    with torch.inference_mode():
        token_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        positions = torch.arange(rows, device=device)
        attn = _SelfAttention(model.config.head_dim**-0.5)
        return model.profile_forward(token_ids, positions, attn)


def _forward_peak(model: LoopedModel, rows: int, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    dummy_forward(model, rows, device)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def profile_cuda_memory(
    model: LoopedModel,
    *,
    max_num_batched_tokens: int,
    prefill_chunk_size: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    graphs: bool,
    paged_attention: bool = False,
) -> CudaMemoryProfile:
    device = model.lm_head.weight.device
    if device.type != "cuda":
        raise RuntimeError("profile_cuda_memory needs the model on a CUDA device")
    config = model.config
    element = model.lm_head.weight.element_size()
    activation = _forward_peak(model, max_num_batched_tokens, device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    weights = torch.cuda.memory_allocated(device)
    scores = 0  # the Triton kernels keep prompt-chunk scores on chip
    if not paged_attention:  # torch: [heads, chunk, context] float32, twice for softmax
        scores = config.num_attention_heads * prefill_chunk_size * max_model_len * 4 * 2
    # Sampling runs after the model's activations are freed: the larger of the two is the peak.
    activation = max(activation, sampling_workspace_bytes(max_num_seqs, config.vocab_size))
    graph_bytes = 0
    if graphs:
        gather = 0
        if not paged_attention:
            max_blocks = -(-min(max_model_len, GRAPH_MAX_CONTEXT) // block_size)
            gather = 2 * max_num_seqs * max_blocks * block_size * config.head_dim * element
            gather *= config.num_key_value_heads
        graph_bytes = _forward_peak(model, max_num_seqs, device) + gather
        once = bool(config.extra_kv_planes)
        graph_bytes += graph_outputs_bytes(
            max_num_seqs, state_width=model.state_width, vocab_size=config.vocab_size,
            element=element, num_forms=4 if once else 2, num_leave_forms=2 if once else 1,
        )  # fmt: skip
    torch.cuda.empty_cache()
    return CudaMemoryProfile(
        total_bytes=total,
        peak_bytes=weights + activation + non_torch + scores,
        graph_bytes=graph_bytes,
    )
