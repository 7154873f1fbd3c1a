"""Prefill/decode hand-off: the state one engine exports and another imports. Torch-free.

A request whose prompt is complete at every depth and whose last output token is sampled
(between decode tokens: no loop of the next token has run) can leave its engine: the
prefill engine EXPORTS a `HandoffState` and finishes the request locally without an output;
the decode engine IMPORTS it, allocates KV blocks for the written positions in every plane,
writes them, restores the sampler's generator state and admits the request straight into
decode. The tensors (`kv`) are opaque here: the runner builds and reads them.

A streamed hand-off (engine/kv_stream.py) moves the same state in parts: the decode engine
reserves the request's blocks first, each plane's run of prompt blocks travels as a `KVChunk`
as soon as it is final (`StepRules.plane_final_depth`), and the `HandoffState` carries the
rest (`first_block` on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.contracts import SampledToken
from loopserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class HandoffState:
    """Everything a request needs to continue decoding on another engine.

    - `kv`: the K/V of positions `[0, num_kv_positions)` of every plane, as one CPU tensor
      `[layers, K/V, planes * blocks, block_size, kv_heads, head_dim]`: plane p's blocks are
      `[p * blocks, (p + 1) * blocks)`; positions past `num_kv_positions` in the last block are
      unused. `num_kv_positions` = prompt + outputs - 1 (the last output token is not fed yet).
      A device tensor when exported with `to_host=False`; None inside a transport's
      descriptor while the bytes travel separately (`loopserve.distributed.transport`).
    - `generator_state`: the request's `torch.Generator.get_state()` bytes; None when greedy.
    - `runner_state`: what a family's executor keeps per request beyond K/V and sampler
      (Huginn: its random initial states and, under the `full` lookup, the steps each
      position ran); None for Ouro. Opaque here, small, picklable (CPU tensors).
    - `first_block`: the first block of each plane `kv` holds (a streamed hand-off: the blocks
      before it reached the importing engine as `KVChunk`s, or came from its prefix cache).
    - The importing engine must have the same model, layout, number of planes and block size.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[SampledToken]
    params: SamplingParams  # resolved against the model depth
    num_planes: int
    block_size: int
    num_kv_positions: int
    kv: object
    generator_state: bytes | None
    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    prompt_logprobs: list[SampledToken] = field(default_factory=list)  # when asked for
    runner_state: object = None
    first_block: int = 0


@dataclass(frozen=True)
class KVChunk:
    """Part of a streamed hand-off: blocks `[first_block, first_block + num_blocks)` of the
    planes `planes` (None: every plane) of a request's prompt, final while its later chunks
    (or, for a shallow plane, the chunk's deeper depths) still run. `kv` as `HandoffState.kv`
    (`[layers, K/V, len(planes) * num_blocks, block_size, heads, head_dim]`, plane-major, the
    planes in `planes`' order); None inside a transport's descriptor."""

    request_id: str
    first_block: int
    num_blocks: int
    kv: object
    planes: tuple[int, ...] | None = None
