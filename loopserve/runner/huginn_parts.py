"""Pieces of the Huginn executor (`runner/huginn_runner.py`): its start-up checks, the
attention router between step planes and the once planes, the per-request state it keeps
(a decode token in flight, the random initial states) and prompt scoring."""

from __future__ import annotations

import dataclasses

import torch

from loopserve.contracts import ItemKind, SampledToken, WorkItem
from loopserve.errors import ConfigError
from loopserve.models.config import once_layer_slot
from loopserve.runner.attention.base import RowSegment
from loopserve.runner.attention.registry import resolve_attention_backend
from loopserve.runner.batch_invariant import make_batch_invariant
from loopserve.runner.transfers import Transfers


def resolve_huginn_config(config):
    """`config` with what `auto` means for Huginn: `graph_mode` auto runs eagerly (the
    family has no graphed path), so a CUDA engine starts without naming it."""
    if config.graph_mode == "auto":
        return dataclasses.replace(config, graph_mode="off")
    return config


def check_huginn_config(config) -> None:
    """Start-up errors for the engine options the Huginn executor does not run (an
    `EngineConfig`): graphs, other exit modes, async scheduling, speculation, and the option
    pairs named below."""
    graph = config.graph_mode if not config.enforce_eager else "off"
    problems = []
    if graph not in ("off", "auto"):  # `auto` is eager for Huginn (`resolve_huginn_config`)
        problems.append(f"graph_mode={config.graph_mode!r} (Huginn runs eagerly: graph_mode='off')")
    if config.batch_invariant and config.exit.lookup == "full":
        problems.append(
            "batch_invariant=True with kv_lookup='full' (row-invariant attention has no "
            "per-step masks)"
        )
    if config.async_scheduling:
        problems.append("async_scheduling=True")
    if config.scheduler.speculative_tokens:
        problems.append("speculative_tokens > 0 (self-speculative decoding is Ouro-only)")
    if config.exit.lookup == "full":
        if config.cache.layout != "last_exited":
            problems.append("kv_lookup='full' outside layout='last_exited'")
        backend = resolve_attention_backend(config.attention_backend, config.device)
        if backend != "torch":
            problems.append(f"kv_lookup='full' on the {backend} attention backend (torch only)")
    if config.exit.prompt_exits:
        if config.scheduler.prefill_mode != "atomic" or config.scheduler.mixed_prefill_decode:
            problems.append("prompt_exits=True outside prefill_mode='atomic' without mixing")
        if config.cache.enable_prefix_caching is not False:
            problems.append("prompt_exits=True with prefix caching (pass it off)")
    if problems:
        raise ConfigError("Huginn-0125 does not run with " + "; ".join(problems))


def make_huginn_batch_invariant(model) -> None:
    """Batch-invariant mode for a Huginn model, in place: its linears and SiLUs row by row
    (`runner.batch_invariant.make_batch_invariant`), and its RoPE tables computed one row at
    a time. The tables are a guard, not a measured fix: cos/sin over [rows, head_dim / 2] are
    elementwise transcendental calls like SiLU, whose vector/scalar split moves with the row
    count on some CPUs; on this project's AMD EPYC (AVX-512) host they measured row-invariant
    at head_dim 8, 96 and 128. Everything else Huginn runs is row-invariant as it is (RMSNorm's
    sqrt and division round exactly in either code; softmax and the criteria reduce per row),
    which tests/test_huginn_batch_invariant.py checks bit for bit."""
    make_batch_invariant(model)
    tables = model.rope

    def rope_row_by_row(positions: torch.Tensor):
        if positions.shape[0] == 0:
            return tables(positions)
        rows = [tables(positions[i : i + 1]) for i in range(positions.shape[0])]
        return torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])

    model.rope = rope_row_by_row


class LayerRouter:
    """The attention backend a Huginn call hands the model: core layers go to the rows'
    step planes, prelude and coda layers to their once planes (`once`: one prepared call
    per once plane; the i-th prelude-or-coda layer is layer i % L of once plane i // L,
    where L is the core's layer count, `once_layer_slot`)."""

    def __init__(self, groups: dict[str, range], core=None, once=()) -> None:
        self.core, self.once = core, once
        self.core_start = groups["core"].start
        self.core_layers = groups["core"]
        prelude, coda = groups["prelude"], groups["coda"]
        per_plane = len(self.core_layers)
        self.once_slot = {
            layer: once_layer_slot(i, per_plane) for i, layer in enumerate([*prelude, *coda])
        }

    def attend(self, layer_idx: int, query, key, value):
        if layer_idx in self.core_layers:
            return self.core.attend(layer_idx - self.core_start, query, key, value)
        plane, layer = self.once_slot[layer_idx]
        return self.once[plane].attend(layer, query, key, value)


OnceSpan = tuple  # (a request's block tables, first position, count): rows of a prelude/coda


def prepare_once(attention, planes: range, spans) -> list:
    """One prepared attention call per once plane over `spans` (`OnceSpan`s)."""
    return [
        attention.prepare(
            [RowSegment(tables[plane], start, count) for tables, start, count in spans]
        )
        for plane in planes
    ]


class DecodeToken:
    """A decode token in flight: its state, its injected prelude output and its criterion
    state (one tensor per `state_fields` entry, without the token dimension)."""

    __slots__ = ("state", "e", "criterion")

    def __init__(self, state: torch.Tensor, e: torch.Tensor, criterion: list[torch.Tensor]):
        self.state, self.e, self.criterion = state, e, criterion


class Latents:
    """A request's random initial states: its generator, the prompt's block (drawn whole at
    the first chunk) and each generated position's row."""

    __slots__ = ("generator", "prompt_len", "prompt", "drawn")

    def __init__(self, generator: torch.Generator, prompt_len: int) -> None:
        self.generator, self.prompt_len = generator, prompt_len
        self.prompt: torch.Tensor | None = None
        self.drawn: dict[int, torch.Tensor] = {}

    def rows(self, start: int, count: int, draw) -> torch.Tensor:
        """Initial states of positions [start, start + count); `draw(rows)` draws new ones
        from this request's generator."""
        if start < self.prompt_len:
            if self.prompt is None:
                self.prompt = draw(self.prompt_len)
            return self.prompt[start : start + count]
        assert count == 1, "generated positions start one at a time"
        if start not in self.drawn:
            self.drawn[start] = draw(1)
        return self.drawn[start]


def score_prompt_rows(
    item: WorkItem, logits: torch.Tensor, loops: int, transfers: Transfers
) -> tuple[SampledToken, ...]:
    """Prompt logprobs of an item with `score_ids`: row i's coda at the request's r steps
    (its exit loops under `prompt_exits`) scores `score_ids[i]`; one copy to the host."""
    if not item.score_ids:
        return ()
    assert not item.score_cached, "Huginn publishes no scored pages"
    count, top = len(item.score_ids), item.score_top
    logprobs = torch.log_softmax(logits[:count].float(), dim=-1)
    chosen = logprobs.gather(1, transfers.to_device(list(item.score_ids))[:, None])
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    columns = [chosen.double(), rank.double()]
    if top:
        values, indices = logprobs.topk(top, dim=-1)
        columns += [values.double(), indices.double()]
    flat = transfers.to_host(torch.cat(columns, dim=1).reshape(-1))
    width, entries = 2 + 2 * top, []
    for row, token_id in enumerate(item.score_ids):
        values = flat[row * width : (row + 1) * width]
        alternatives = tuple((int(values[2 + top + j]), values[2 + j]) for j in range(top))
        entries.append(SampledToken(token_id, values[0], alternatives, int(values[1]), loops))
    return tuple(entries)


def refused_items(items, prompt_exits: bool, prompt_lens: dict[str, int]) -> dict[str, str]:
    """Requests whose items this executor cannot run, with the reason (each fails alone).
    Under `prompt_exits` a prompt item must hold the whole prompt (`prompt_lens`): on its
    first pass and when it is recomputed after a preemption."""
    reasons = {}
    for item in items:
        if item.kind is ItemKind.PROMPT and item.score_rule is not None:
            reasons[item.request_id] = (
                "prompt logprobs at the exit loop are not supported for Huginn yet "
                "(prompt_logprobs_loop='last' is)"
            )
        elif (
            prompt_exits
            and item.kind is ItemKind.PROMPT
            and (item.token_start > 0 or item.token_count != prompt_lens[item.request_id])
        ):
            reasons[item.request_id] = (
                "with prompt_exits the whole prompt must be one chunk: raise "
                "prefill_chunk_size and max_num_batched_tokens above its length"
            )
    return reasons
