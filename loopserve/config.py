"""Frozen engine configuration, validated once at start-up.

`EngineConfig.from_engine_args(**kwargs)` takes the flat names of the engine-argument table
(`loopserve.engine_args`), shared by `LLM(...)` and the CLI flags (`block_size`, `layout`,
`max_num_seqs`, `mode`, `exit_mode`, ...); the dataclass defaults come from that table too.
Values that depend on the model ("auto" dtype, the number of KV blocks) are resolved by pure functions
with `dataclasses.replace`; nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loopserve.engine_args import (  # noqa: F401  (the choice lists, re-exported)
    ATTENTION_BACKENDS,
    CODA_BATCHING,
    ENGINE_ARGS_BY_NAME,
    EXIT_MODES,
    GRAPH_MODES,
    KV_CACHE_DTYPES,
    KV_RESERVATIONS,
    LAYOUTS,
    MODES,
    PREEMPTION_MODES,
    PREFILL_MODES,
    SCHEDULING_POLICIES,
    default,
)
from loopserve.errors import ConfigError

DEFAULT_CPU_KV_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = default("block_size")
    num_blocks: int | None = default("num_blocks")  # None: from kv_cache_bytes or free memory
    kv_cache_bytes: int | None = default("kv_cache_bytes")
    kv_cache_dtype: str = default("kv_cache_dtype")  # auto: the model's dtype
    layout: str = default("layout")
    gpu_memory_utilization: float = default("gpu_memory_utilization")
    kv_reservation: str = default("kv_reservation")
    kv_watermark: float = default("kv_watermark")
    swap_space: int = default("swap_space")
    enable_prefix_caching: bool | None = default("enable_prefix_caching")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = default("max_num_seqs")
    max_num_batched_tokens: int = default("max_num_batched_tokens")
    prefill_chunk_size: int = default("prefill_chunk_size")
    mode: str = default("mode")
    prefill_mode: str = default("prefill_mode")
    mixed_prefill_decode: bool = default("mixed_prefill_decode")
    fill_prompt_chunks: bool = default("fill_prompt_chunks")
    share_prompts: bool = default("share_prompts")
    max_prefill_batches_before_decode: int = default("max_prefill_batches_before_decode")
    preemption_mode: str = default("preemption_mode")
    scheduling_policy: str = default("scheduling_policy")
    speculative_tokens: int = default("speculative_tokens")
    draft_loops: int = default("draft_loops")
    speculative_max_seqs: int = default("speculative_max_seqs")
    brownout_waiting_high: int = default("brownout_waiting_high")
    brownout_waiting_low: int = default("brownout_waiting_low")
    brownout_step_loops: int = default("brownout_step_loops")
    brownout_max_level: int = default("brownout_max_level")
    brownout_dwell_steps: int = default("brownout_dwell_steps")
    coda_batching: str = default("coda_batching")
    coda_batch_max_wait: int = default("coda_batch_max_wait")
    coda_batch_min_rows: int | None = default("coda_batch_min_rows")

    def __post_init__(self) -> None:
        # One meaning of "mixed": prompt rows ride in decode calls one depth at a time, so an
        # atomic prompt policy (the default) becomes per_depth; the resolved config says so.
        if self.mixed_prefill_decode and self.prefill_mode == "atomic":
            object.__setattr__(self, "prefill_mode", "per_depth")


@dataclass(frozen=True)
class ExitConfig:
    mode: str = default("exit_mode")
    lookahead_seed: int = default("lookahead_seed")
    criterion: str = default("exit_criterion")
    prompt_exits: bool = default("prompt_exits")
    lookup: str = default("kv_lookup")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = default("model")  # None: the embedded default model
    revision: str | None = default("revision")  # a Hub id's revision (None: main)
    download_dir: str | None = default("download_dir")  # None: the Hugging Face cache
    dtype: str = default("dtype")
    device: str = default("device")
    trust_remote_code: bool = default("trust_remote_code")  # ignored: no checkpoint code runs
    chat_template: str | None = default("chat_template")  # a path or a template; None: ckpt's
    max_model_len: int | None = default("max_model_len")
    num_loops: int | None = default("num_loops")  # None: the checkpoint's D
    attention_backend: str = default("attention_backend")
    graph_mode: str = default("graph_mode")
    enforce_eager: bool = default("enforce_eager")
    async_scheduling: bool = default("async_scheduling")
    batch_invariant: bool = default("batch_invariant")
    fused_linears: bool = default("fused_linears")
    cascade_attention: bool | None = default("cascade_attention")  # None: see cascade_enabled
    init_scale: float = default("init_scale")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_engine_args(cls, **kwargs: object) -> EngineConfig:
        """Build from flat names (the engine-argument table); unknown names raise with the
        list of valid ones."""
        parts: dict[str, dict[str, object]] = {"cache": {}, "scheduler": {}, "exit": {}, "top": {}}
        for name, value in kwargs.items():
            arg = ENGINE_ARGS_BY_NAME.get(name)
            if arg is None:
                raise ConfigError(
                    f"unknown engine argument {name!r}; valid: {sorted(engine_arg_names())}"
                )
            parts[arg.group][arg.field] = value
        try:
            return cls(
                **parts["top"],
                cache=CacheConfig(**parts["cache"]),
                scheduler=SchedulerConfig(**parts["scheduler"]),
                exit=ExitConfig(**parts["exit"]),
            )
        except TypeError as err:
            raise ConfigError(str(err)) from err


def engine_arg_names() -> set[str]:
    return set(ENGINE_ARGS_BY_NAME)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _async_exit_mode_error(mode: str) -> str:
    """Why async scheduling cannot run `mode` ('ouro', the default, which means the
    criterion rule for a Huginn checkpoint, or 'criterion'), and the delayed rule to use."""
    if mode == "criterion":
        named, instead = "exit_mode='criterion'", "use exit_mode='criterion_delayed'"
    else:
        named = "exit_mode='ouro' (the default: Ouro's gate, or a Huginn checkpoint's criterion)"
        instead = (
            "use exit_mode='ouro_delayed' for Ouro's gate or 'criterion_delayed' for Huginn's "
            "criterion (the same rule, exiting one loop later), or 'random_lookahead' or "
            "'trace' (Ouro)"
        )
    return (
        f"async_scheduling needs an exit rule known one loop ahead, but {named} decides each "
        "exit from the signal of the loop just run, so step n+1's rows would depend on step "
        f"n's results; {instead}, or turn async_scheduling off"
    )


def validate(config: EngineConfig) -> None:
    cache, sched, exit_ = config.cache, config.scheduler, config.exit
    _positive_int("block_size", cache.block_size)
    if cache.num_blocks is not None:
        _positive_int("num_blocks", cache.num_blocks)
    if cache.kv_cache_bytes is not None:
        _positive_int("kv_cache_bytes", cache.kv_cache_bytes)
    if not 0.0 < cache.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1], got {cache.gpu_memory_utilization}"
        )
    _choice("layout", cache.layout, LAYOUTS)
    _choice("kv_cache_dtype", cache.kv_cache_dtype, KV_CACHE_DTYPES)
    _choice("kv_reservation", cache.kv_reservation, KV_RESERVATIONS)
    if not 0.0 <= cache.kv_watermark < 1.0:
        raise ConfigError(f"kv_watermark must be in [0, 1), got {cache.kv_watermark}")
    if not isinstance(cache.swap_space, int) or cache.swap_space < 0:
        raise ConfigError(f"swap_space must be a non-negative byte count, got {cache.swap_space!r}")
    _choice("preemption_mode", sched.preemption_mode, PREEMPTION_MODES)
    _choice("scheduling_policy", sched.scheduling_policy, SCHEDULING_POLICIES)
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "prefill_chunk_size",
        "max_prefill_batches_before_decode",
    ):
        _positive_int(name, getattr(sched, name))
    if config.max_model_len is not None:
        _positive_int("max_model_len", config.max_model_len)
    if config.num_loops is not None:
        _positive_int("num_loops", config.num_loops)
    _check_speculation(config)
    _check_brownout(sched)
    _check_coda_batching(config)
    _choice("mode", sched.mode, MODES)
    _choice("prefill_mode", sched.prefill_mode, PREFILL_MODES)
    _choice("exit_mode", exit_.mode, EXIT_MODES)
    _choice("device", config.device.split(":")[0], ("cpu", "cuda"))
    _choice("attention_backend", config.attention_backend, ATTENTION_BACKENDS)
    _choice("graph_mode", config.graph_mode, GRAPH_MODES)
    if config.async_scheduling and exit_.mode in ("ouro", "criterion"):
        raise ConfigError(_async_exit_mode_error(exit_.mode))
    if exit_.prompt_exits and exit_.mode == "criterion_delayed":
        raise ConfigError(
            "prompt_exits=True with exit_mode='criterion_delayed': a prompt exits by the "
            "authors' rule (exit_mode='criterion'); the delayed rule is for decode tokens"
        )
    if config.batch_invariant:
        _check_batch_invariant(config)
    if sched.prefill_chunk_size > sched.max_num_batched_tokens:
        raise ConfigError(
            f"prefill_chunk_size ({sched.prefill_chunk_size}) must be <= max_num_batched_tokens "
            f"({sched.max_num_batched_tokens}); lower the chunk size or raise the budget"
        )
    if sched.max_num_seqs > sched.max_num_batched_tokens:
        raise ConfigError(
            f"max_num_seqs ({sched.max_num_seqs}) must be <= max_num_batched_tokens "
            f"({sched.max_num_batched_tokens}): every running decode token needs a row"
        )
    needs_last_exited = sched.prefill_mode == "wavefront" or sched.mixed_prefill_decode
    if needs_last_exited and cache.layout == "shared":
        raise ConfigError(
            "wavefront and mixed prompt work need layout='last_exited': under SHARED a prompt "
            "position must be final before later positions read it"
        )
    if sched.mixed_prefill_decode:
        needed = sched.prefill_chunk_size + sched.max_num_seqs - 1
        if needed > sched.max_num_batched_tokens:
            raise ConfigError(
                f"mixed_prefill_decode needs prefill_chunk_size + max_num_seqs - 1 <= "
                f"max_num_batched_tokens, got {sched.prefill_chunk_size} + {sched.max_num_seqs} - 1 "
                f"= {needed} > {sched.max_num_batched_tokens}; set max_num_batched_tokens >= {needed} "
                f"or lower prefill_chunk_size / max_num_seqs"
            )


def _check_coda_batching(config: EngineConfig) -> None:
    sched = config.scheduler
    _choice("coda_batching", sched.coda_batching, CODA_BATCHING)
    _positive_int("coda_batch_max_wait", sched.coda_batch_max_wait)
    if sched.coda_batch_min_rows is not None:
        _positive_int("coda_batch_min_rows", sched.coda_batch_min_rows)
    if sched.coda_batching == "on" and config.async_scheduling:
        raise ConfigError(
            "coda_batching='on' with async_scheduling: a step planned before the last one's "
            "exits are known cannot batch their leaves; turn one of them off"
        )


def resolve_coda_batching(config: EngineConfig, *, once_weight: float, reads_logits: bool) -> bool:
    """Whether the engine batches leaves in time: `coda_batching` on/off as set; auto is on
    when the family's once-per-token layers weigh at least half a loop (`once_weight`, in
    loops: Huginn-0125's 2 prelude + 2 coda layers against a 4-layer core, 1.0; Ouro 0), the
    exit signal reads no logits (a criterion that does runs the coda at every checked loop
    already) and scheduling is synchronous."""
    mode = config.scheduler.coda_batching
    if mode != "auto":
        return mode == "on"
    return once_weight >= 0.5 and not reads_logits and not config.async_scheduling


def _check_speculation(config: EngineConfig) -> None:
    sched = config.scheduler
    tokens, loops = sched.speculative_tokens, sched.draft_loops
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ConfigError(f"speculative_tokens must be an integer >= 0, got {tokens!r}")
    _positive_int("draft_loops", loops)
    _positive_int("speculative_max_seqs", sched.speculative_max_seqs)
    if not tokens:
        return
    if config.cache.layout == "shared":
        raise ConfigError(
            "speculative_tokens > 0 needs layout='last_exited': a draft position's early loops "
            "would overwrite the one SHARED plane that later positions read as its final K/V, "
            "so drafted and verified tokens would differ from plain decoding; use "
            "layout='last_exited' or speculative_tokens=0"
        )
    if tokens + 1 > sched.max_num_batched_tokens:
        raise ConfigError(
            f"speculative_tokens + 1 ({tokens + 1}) rows of one request must fit in "
            f"max_num_batched_tokens ({sched.max_num_batched_tokens})"
        )


def check_draft_loops(config: EngineConfig, num_loops: int) -> None:
    """Self-speculative decoding drafts after `draft_loops` of the model's D loops: at least
    one loop must be left to verify."""
    sched = config.scheduler
    if sched.speculative_tokens and sched.draft_loops >= num_loops:
        raise ConfigError(
            f"draft_loops ({sched.draft_loops}) must be below the model's loops ({num_loops}): "
            "a draft is verified by the loops after it"
        )


def _check_batch_invariant(config: EngineConfig) -> None:
    """Batch-invariant mode runs only where every row's reduction is its own: the torch
    attention path, without the padded static buffers of graphs."""
    if config.attention_backend == "triton":
        raise ConfigError(
            "batch_invariant=True needs the torch attention path (each row attends alone over "
            "exactly its own context); the Triton kernels are not row-invariant by design or "
            "test; use attention_backend='torch' (or 'auto', which picks torch in this mode) "
            "or turn batch_invariant off"
        )
    if config.cascade_attention:
        raise ConfigError(
            "batch_invariant=True cannot run cascade_attention=True: a group's shared-prefix "
            "pass ties each row's bits to the other rows of its group; leave cascade_attention "
            "unset (off in this mode) or turn batch_invariant off"
        )
    if config.graph_mode == "emulate":
        raise ConfigError(
            "batch_invariant=True cannot run graph_mode='emulate': graph buckets pad each row's "
            "context to the bucket's bound, which changes the row's reduction; use "
            "graph_mode='auto' (eager in this mode) or 'off'"
        )
    if config.fused_linears:
        raise ConfigError(
            "batch_invariant=True cannot run fused_linears=True: the fused GEMMs take a call's "
            "rows in one tile, so a row's sums depend on the call; turn one of them off"
        )


def effective_graph_mode(config: EngineConfig) -> str:
    """'capture' (CUDA graphs), 'emulate' (static padded buffers, run eagerly) or 'off'.
    Batch-invariant mode always runs eagerly (its validation rejects an explicit 'emulate')."""
    if config.enforce_eager or config.graph_mode == "off" or config.batch_invariant:
        return "off"
    if config.graph_mode == "emulate":
        return "emulate"
    return "capture" if config.device.startswith("cuda") else "off"


def prefix_caching_enabled(cache: CacheConfig) -> bool:
    """`enable_prefix_caching`, with None resolved: on for LAST_EXITED, off for SHARED."""
    if cache.enable_prefix_caching is None:
        return cache.layout == "last_exited"
    return cache.enable_prefix_caching


def cascade_enabled(config: EngineConfig) -> bool:
    """`cascade_attention`, with None resolved: on exactly when prefix caching is on (only
    prefix-cache hits make rows of different requests share KV blocks)."""
    if config.batch_invariant:
        return False  # a group's shared-prefix pass would tie each row's bits to the others
    if config.cascade_attention is None:
        return prefix_caching_enabled(config.cache)
    return config.cascade_attention


def resolve_dtype(config: EngineConfig) -> EngineConfig:
    if config.dtype != "auto":
        return config
    return dataclasses.replace(
        config, dtype="bfloat16" if config.device.startswith("cuda") else "float32"
    )


def max_inflight_rows(config: EngineConfig, num_loops: int) -> int:
    """Upper bound on hidden-state rows the runner holds between steps.

    Per running request: one decode token, or its in-flight prompt chunks (wavefront: up to
    D chunks at different depths; per-depth/mixed: one), plus D last-row outputs of the
    chunk holding the last prompt position; with self-speculative decoding, its drafted
    positions too.
    """
    sched = config.scheduler
    chunks = num_loops if sched.prefill_mode == "wavefront" else 1
    if sched.prefill_mode == "atomic":  # never with mixed_prefill_decode (SchedulerConfig)
        chunks = 0  # atomic chunks finish inside their step
    per_request = max(1, chunks * sched.prefill_chunk_size) + num_loops
    return sched.max_num_seqs * (per_request + sched.speculative_tokens)


def cuda_kv_budget(
    *,
    total_bytes: int,
    gpu_memory_utilization: float,
    peak_bytes: int,
    graph_bytes: int = 0,
) -> int:
    """KV byte budget on CUDA, as vLLM: `total x utilization` minus what the engine itself
    needs at its peak (`peak_bytes`: weights, the activation peak of a dummy forward at
    `max_num_batched_tokens` rows, and memory outside torch's allocator, all measured) minus
    the CUDA graphs' pool (`graph_bytes`; captured after the KV cache exists, so estimated).
    Raises when nothing is left, naming every term."""
    budget = int(total_bytes * gpu_memory_utilization) - peak_bytes - graph_bytes
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: {total_bytes} total x "
            f"gpu_memory_utilization {gpu_memory_utilization} - {peak_bytes} at the profiled "
            f"peak - {graph_bytes} for CUDA graphs = {budget} bytes; raise "
            "gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or set "
            "enforce_eager"
        )
    return budget


def resolve_num_blocks(
    cache: CacheConfig,
    *,
    bytes_per_block: int,
    free_bytes: int | None,
    reserved_bytes: int = 0,
    budget_bytes: int | None = None,
) -> CacheConfig:
    """Fix `num_blocks` from an explicit count, a byte budget, a profiled budget
    (`budget_bytes`, from `cuda_kv_budget`) or free memory x utilization."""
    if cache.num_blocks is not None:
        return cache
    if cache.kv_cache_bytes is not None:
        budget = cache.kv_cache_bytes
    elif budget_bytes is not None:
        budget = budget_bytes
    elif free_bytes is not None:
        budget = int(free_bytes * cache.gpu_memory_utilization)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    if cache.kv_cache_bytes is None:
        budget -= reserved_bytes  # in-flight hidden states share the memory plan
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"KV budget of {budget} bytes holds no block of {bytes_per_block} bytes; "
            "raise kv_cache_bytes / gpu_memory_utilization or lower block_size"
        )
    return dataclasses.replace(cache, num_blocks=num_blocks)


def _check_brownout(sched: SchedulerConfig) -> None:
    if sched.brownout_waiting_high < 0:
        raise ConfigError("brownout_waiting_high must be >= 0 (0: brownout off)")
    if not sched.brownout_waiting_high:
        return
    if not 0 <= sched.brownout_waiting_low < sched.brownout_waiting_high:
        raise ConfigError(
            "brownout_waiting_low must be in [0, brownout_waiting_high): the budget returns "
            "below the level that lowered it (hysteresis)"
        )
    for name in ("brownout_step_loops", "brownout_max_level", "brownout_dwell_steps"):
        _positive_int(name, getattr(sched, name))
