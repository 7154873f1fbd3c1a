"""An engine's model and memory plan, before the engine is wired: `load_engine_model` (the
model resolved, its options checked against its config.json before a weight is read,
`check_against_checkpoint`, loaded, and the config with what `auto` and the default exit
mode mean for it), `resolve_model_options` (what `auto` means for this model, and a
start-up error naming every option the runner cannot run for it), `size_kv_cache` (K/V
blocks from the byte budget, profiling the device first on CUDA) and `reads_logits` (whether
the exit signal reads logits at every checked loop). `LLMEngine.__init__` calls them in that
order; nothing here holds state.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from loopserve.config import (
    EngineConfig,
    check_draft_loops,
    cuda_kv_budget,
    effective_graph_mode,
    max_inflight_rows,
    prefix_caching_enabled,
    resolve_dtype,
    resolve_num_blocks,
)
from loopserve.errors import ConfigError
from loopserve.exit import ExitMode
from loopserve.exit.criteria import make_criterion
from loopserve.models import load_model, resolve_model_path
from loopserve.models.kv_dtype import FP8_E4M3_MIN_CAPABILITY, kv_storage_dtype
from loopserve.models.loader import opted_in
from loopserve.models.registry import read_config, require_engine_family, resolve_exit_mode
from loopserve.models.tiny import DEFAULT_MODEL_DIR
from loopserve.runner.attention.registry import resolve_attention_backend
from loopserve.runner.capabilities import unsupported_options
from loopserve.runner.memory_profile import profile_cuda_memory

logger = logging.getLogger(__name__)
# Opts in to a max_model_len longer than the checkpoint's positions (`check_max_model_len`).
LONG_CONTEXT_ENV = "LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN"


def reads_logits(config: EngineConfig, model) -> bool:
    """The engine's exit signal reads logits at every checked loop (a convergence criterion
    such as kl or argmax-stability): the coda runs there already."""
    if not ExitMode(config.exit.mode).reads_criterion:
        return False
    vocab = model.config.vocab_size
    return make_criterion(config.exit.criterion, vocab_size=vocab).needs_logits


def load_engine_model(config: EngineConfig):
    """(family, model, config) of an engine: the model resolved (a directory, or a Hub id in
    the local cache or downloaded when allowed), its options checked against its config.json
    before its weights are read (`check_against_checkpoint`), loaded, and the config with what
    `auto` and the default exit mode mean for it."""
    config = resolve_dtype(config)
    model_path = resolve_model_path(
        config.model or DEFAULT_MODEL_DIR,
        revision=config.revision,
        download_dir=config.download_dir,
    )
    family, config = check_against_checkpoint(config, model_path)
    model = load_model(
        model_path, dtype=config.dtype, device=config.device, num_loops=config.num_loops
    )
    if config.device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(config.device)
        check_kv_cache_dtype(config, 10 * major + minor)
    return family, model, config


def check_against_checkpoint(config: EngineConfig, model_path: str | os.PathLike):
    """(family, config) for an engine of the checkpoint at `model_path`, from its config.json
    alone (no weight is read): a start-up error for a family the engine does not run, an exit
    mode its signal cannot drive, a context longer than its positions (unless
    `LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN=1`), a draft that leaves no loop to verify, or an
    option its math rules out; the config with the family's exit mode and what `auto` means
    for it. `load_engine_model` calls it before the weights load, `loopserve serve` before it
    binds a port or starts a replica."""
    family, model_config = read_config(model_path)
    require_engine_family(family)
    exit_mode = resolve_exit_mode(family, config.exit.mode)
    config = dataclasses.replace(config, exit=dataclasses.replace(config.exit, mode=exit_mode))
    if config.num_loops is not None:
        model_config = model_config.with_loops(config.num_loops)
    check_max_model_len(config.max_model_len, model_config.max_position_embeddings)
    check_draft_loops(config, model_config.num_loops)
    config = resolve_model_options(
        config, family.model_class.signal_kind, model_config.extra_kv_planes, family.name
    )
    return family, config


def check_max_model_len(max_model_len: int | None, limit: int) -> None:
    """A start-up error for a context longer than the checkpoint's positions (`limit`, its
    `max_position_embeddings`): the model was not trained there, and every table sized by
    the context grows with it. `LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN=1` allows it (a warning
    is logged; the rotary is computed for any position, and the fused linears' tables cover
    `max_model_len`), as vLLM's `VLLM_ALLOW_LONG_MAX_MODEL_LEN` does."""
    if max_model_len is None or max_model_len <= limit:
        return
    if not opted_in(LONG_CONTEXT_ENV):
        raise ConfigError(
            f"max_model_len={max_model_len} is longer than the model's {limit} positions "
            f"(max_position_embeddings in its config.json): pass at most {limit}, or set "
            f"{LONG_CONTEXT_ENV}=1 to run positions it was not trained on"
        )
    logger.warning(
        "max_model_len=%d is longer than the model's %d positions (%s=1): positions past "
        "%d are ones the model was not trained on", max_model_len, limit, LONG_CONTEXT_ENV, limit
    )  # fmt: skip


def check_kv_cache_dtype(config: EngineConfig, capability: int) -> None:
    """A start-up error for a cache the attention kernels cannot read on this GPU (compute
    capability `capability`, e.g. 80): e4m3 before sm_89 with the Triton backend."""
    backend = resolve_attention_backend(
        config.attention_backend, config.device, batch_invariant=config.batch_invariant
    )
    if (
        config.cache.kv_cache_dtype == "fp8_e4m3"
        and backend == "triton"
        and capability < FP8_E4M3_MIN_CAPABILITY
    ):
        raise ConfigError(
            f"kv_cache_dtype='fp8_e4m3' needs compute capability 8.9 or later with the Triton "
            f"attention backend (this GPU: {capability // 10}.{capability % 10}; Triton has no "
            "e4m3 conversion before it); use kv_cache_dtype='fp8_e5m2' or 'auto'"
        )


def size_kv_cache(config: EngineConfig, model, max_model_len: int):
    """(the cache config with its block count, K/V bytes per block, bytes reserved for
    in-flight hidden states). On CUDA without an explicit size the device is profiled first
    (weights, activation peak, the graphs' pool) and the blocks fill what is left."""
    element_size = model.lm_head.weight.element_size()
    kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, model.lm_head.weight.dtype)
    bytes_per_block = model.config.kv_bytes_per_block(config.cache.block_size, kv_dtype.itemsize)
    budget = None
    sized = config.cache.num_blocks is not None or config.cache.kv_cache_bytes is not None
    if config.device.startswith("cuda") and not sized:
        profile = profile_cuda_memory(
            model,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            prefill_chunk_size=config.scheduler.prefill_chunk_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=max_model_len,
            block_size=config.cache.block_size,
            graphs=effective_graph_mode(config) == "capture",
            paged_attention=resolve_attention_backend(
                config.attention_backend, config.device, batch_invariant=config.batch_invariant
            )
            == "triton",
        )
        budget = cuda_kv_budget(
            total_bytes=profile.total_bytes,
            gpu_memory_utilization=config.cache.gpu_memory_utilization,
            peak_bytes=profile.peak_bytes,
            graph_bytes=profile.graph_bytes,
        )
    inflight_rows = max_inflight_rows(config, model.num_loops)
    inflight_hidden_bytes = inflight_rows * model.config.hidden_size * element_size
    # The fused linears' rotary tables (every position up to max_model_len) come after the
    # profile, with the runner: reserved here so that the blocks leave room for them.
    table_bytes = 0
    if config.fused_linears and config.device.startswith("cuda"):
        table_bytes = getattr(model, "rope_table_bytes", lambda _: 0)(max_model_len)
    # With prefix caching, the runner's score store keeps one hidden vector per KV slot
    # (prompt rows' last-loop outputs): sized with the blocks.
    store_bytes = 0
    if prefix_caching_enabled(config.cache):
        store_bytes = config.cache.block_size * model.config.hidden_size * element_size
    cache = resolve_num_blocks(
        config.cache,
        bytes_per_block=bytes_per_block + store_bytes,
        free_bytes=None,
        reserved_bytes=inflight_hidden_bytes + table_bytes,
        budget_bytes=budget,
    )
    return cache, bytes_per_block, inflight_hidden_bytes


def resolve_model_options(
    config: EngineConfig, signal_kind: str, once_planes: int, family_name: str
) -> EngineConfig:
    """`config` with what `auto` means for a model with this exit signal (`signal_kind`) and
    this many once planes (graph_mode auto runs eagerly for a model or options the decode
    graphs do not run, or have not run on a GPU, so a CUDA engine starts without naming it),
    and a start-up error naming every option the runner cannot run for it
    (`unsupported_options`)."""
    # `auto` captures graphs only for what has run captured on a GPU: a family with once
    # planes or a criterion runs graphs when asked (emulate is tested on CPU; capture has not
    # run on a GPU yet), and eagerly by default.
    unverified = signal_kind == "criterion" or bool(once_planes)
    if config.graph_mode == "auto" and (
        unverified
        or unsupported_options(
            signal_kind,
            graph_mode="capture",
            init_scale=config.init_scale,
            lookup=config.exit.lookup,
        )
    ):
        config = dataclasses.replace(config, graph_mode="off")
    scheduler = config.scheduler
    problems = unsupported_options(
        signal_kind,
        graph_mode="off"
        if config.enforce_eager or config.graph_mode == "auto"
        else config.graph_mode,
        speculative=bool(scheduler.speculative_tokens),
        batch_invariant=config.batch_invariant,
        lookup=config.exit.lookup,
        layout=config.cache.layout,
        attention_backend=resolve_attention_backend(config.attention_backend, config.device),
        prompt_exits=config.exit.prompt_exits,
        chunked_or_mixed_prompts=scheduler.prefill_mode != "atomic"
        or scheduler.mixed_prefill_decode,
        prefix_caching=config.cache.enable_prefix_caching is not False,
        init_scale=config.init_scale,
    )
    if problems:
        raise ConfigError(f"{family_name} does not run with " + "; ".join(problems))
    return config
