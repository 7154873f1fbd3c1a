"""What a `ModelRunner` is built with besides the model: one frozen record of its options.

`RunnerOptions.of` reads them from an engine config (the `LLMEngine`'s builder); tests and
tools build the record directly. The runner's constructor validates them against the
model's math (`unsupported_options`) and builds its parts from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.config import EngineConfig, cascade_enabled, effective_graph_mode


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """`graph_mode`: 'off' (eager), 'emulate' or 'capture' (`loopserve.runner.graphs`); with
    graphs the KV tensor has one extra block (index `num_blocks`) for padding rows.
    `score_store` (with prefix caching): keep every prompt row's last-loop output per KV
    slot, so requests that reuse a cached page can score its positions. `batch_invariant`:
    run the model row by row, in place (`loopserve.runner.batch_invariant`); needs graph_mode
    'off'. `fused_linears`: on CUDA, decode calls of few rows run the GEMMs with their
    neighbours fused in (`runner/fused_linear.py`). A criterion family (`signal_kind`): `criterion` and its engine-wide
    `criterion_threshold` (None: the authors' default; each request's `exit_threshold`
    overrides it where the criterion takes one), `init_scale` (> 0: drawn initial states),
    `prompt_exits` and `lookup` (`runner/loop_calls.py`); `per_request_prompt_loops`: prompts
    run the request's loop bound (the registry's `prompt_loops_by_request`);
    `defers_leave`: coda batching in time (`StepRules.defers_leave`). `kv_cache_dtype`: the
    KV cache's element type (`models/kv_dtype.py`; auto: the model's dtype)."""

    num_blocks: int
    block_size: int
    layout: str = "last_exited"
    exit_mode: str = "ouro"
    lookahead_seed: int = 0
    num_host_blocks: int = 0
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    graph_mode: str = "off"
    max_model_len: int | None = None
    max_num_seqs: int = 1
    batch_invariant: bool = False
    fused_linears: bool = False
    cascade_attention: bool = False
    score_store: bool = False
    criterion: str = "none"
    criterion_threshold: float | None = None
    init_scale: float = 0.0
    prompt_exits: bool = False
    lookup: str = "last_exited"
    per_request_prompt_loops: bool = False
    defers_leave: bool = False

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        *,
        max_model_len: int,
        num_host_blocks: int,
        score_store: bool,
        per_request_prompt_loops: bool,
        defers_leave: bool = False,
    ) -> RunnerOptions:
        """The options of an engine's runner (`config` resolved: its cache sized)."""
        cache, exit_ = config.cache, config.exit
        assert cache.num_blocks is not None, "size the KV cache first"
        return cls(
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            layout=cache.layout,
            exit_mode=exit_.mode,
            lookahead_seed=exit_.lookahead_seed,
            num_host_blocks=num_host_blocks,
            kv_cache_dtype=cache.kv_cache_dtype,
            attention_backend=config.attention_backend,
            graph_mode=effective_graph_mode(config),
            max_model_len=max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            batch_invariant=config.batch_invariant,
            fused_linears=config.fused_linears,
            cascade_attention=cascade_enabled(config),
            score_store=score_store,
            criterion=exit_.criterion,
            init_scale=config.init_scale,
            prompt_exits=exit_.prompt_exits,
            lookup=exit_.lookup,
            per_request_prompt_loops=per_request_prompt_loops,
            defers_leave=defers_leave,
        )
