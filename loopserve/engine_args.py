"""The engine-argument table: every `LLM(...)` keyword, CLI flag, default and help in one place.

`EngineConfig` takes its field defaults from this table, `EngineConfig.from_engine_args`
routes each flat name to its config group through it, and `add_engine_args` turns it into
argparse flags (`block_size` -> `--block-size`). Torch-free; the tools import it too.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LAYOUTS = ("last_exited", "shared")
MODES = ("refill", "no_refill")
PREFILL_MODES = ("atomic", "per_depth", "wavefront")
EXIT_MODES = (
    "ouro", "ouro_delayed", "random_lookahead", "trace", "criterion", "criterion_delayed"
)  # fmt: skip
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # models/kv_dtype.py
KV_RESERVATIONS = ("incremental", "full")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # resolved per device by the runner's registry
DEFAULT_SWAP_SPACE_BYTES = 4 * 1024**3
GRAPH_MODES = ("auto", "off", "emulate")
CODA_BATCHING = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineArg:
    """One engine argument: `name` is the `LLM` keyword; `group.field` its place in the config
    (`group` is "top" for `EngineConfig` itself, else "cache", "scheduler" or "exit")."""

    name: str
    group: str
    field: str
    default: object
    help: str
    type: type | None = None  # None: a string; bool: an on/off flag
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg("model", "top", "model", None, "checkpoint dir or Hub id (None: the embedded model)"),
    EngineArg("revision", "top", "revision", None, "a Hub id's branch, tag or commit (None: "
              "main)"),
    EngineArg("download_dir", "top", "download_dir", None, "the Hugging Face cache a Hub id is "
              "looked up in and downloaded to (None: HF_HUB_CACHE or HF_HOME/hub)"),
    EngineArg("dtype", "top", "dtype", "auto", "weights/activations dtype; auto: bfloat16 on CUDA, "
              "float32 on CPU", choices=DTYPES),
    EngineArg("device", "top", "device", "cpu", "cpu or cuda[:N]"),
    EngineArg("trust_remote_code", "top", "trust_remote_code", False, "accepted, as vLLM's "
              "and transformers' commands for Ouro and Huginn pass it, and ignored: loopserve "
              "runs its own implementation of every family, never a checkpoint's code", bool),
    EngineArg("chat_template", "top", "chat_template", None, "the Jinja chat template chat "
              "requests are rendered with: a file's path, or the template itself (None: the "
              "checkpoint's, from tokenizer_config.json or chat_template.jinja)"),
    EngineArg("max_model_len", "top", "max_model_len", None, "longest prompt + output in tokens "
              "(None: the model's max_position_embeddings; more is a start-up error unless "
              "LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN=1)", int),
    EngineArg("num_loops", "top", "num_loops", None, "loops per token the engine runs at most, "
              "D (None: the checkpoint's, Ouro's total_ut_steps or Huginn's mean_recurrence); "
              "requests ask for fewer with max_loops. Every request holds a K/V plane per loop "
              "under last_exited, so a smaller D holds less; Huginn runs more steps than its "
              "default with a larger one", int),
    EngineArg("attention_backend", "top", "attention_backend", "auto", "paged attention "
              "implementation; auto: triton on CUDA, torch elsewhere (triton on CPU needs "
              "TRITON_INTERPRET=1)", choices=ATTENTION_BACKENDS),
    EngineArg("block_size", "cache", "block_size", 16, "tokens per KV block", int),
    EngineArg("num_blocks", "cache", "num_blocks", None, "KV blocks (None: from "
              "--kv-cache-bytes on CPU, free memory x --gpu-memory-utilization on CUDA)", int),
    EngineArg("kv_cache_bytes", "cache", "kv_cache_bytes", None, "KV cache byte budget "
              "(None: 512 MiB on CPU, free memory on CUDA)", int),
    EngineArg("kv_cache_dtype", "cache", "kv_cache_dtype", "auto", "K/V element type: auto "
              "(the model's dtype), or fp8_e4m3 / fp8_e5m2 (one byte per element, values "
              "clamped to the type's range, no scale): twice the tokens per byte of bf16 and "
              "half the bytes each loop reads", choices=KV_CACHE_DTYPES),
    EngineArg("layout", "cache", "layout", "last_exited", "KV layout: last_exited keeps a token's "
              "K/V of every depth it ran; shared keeps one per position", choices=LAYOUTS),
    EngineArg("gpu_memory_utilization", "cache", "gpu_memory_utilization", 0.9,
              "share of free CUDA memory the KV cache may use", float),
    EngineArg("max_num_seqs", "scheduler", "max_num_seqs", 64, "requests running at once", int),
    EngineArg("max_num_batched_tokens", "scheduler", "max_num_batched_tokens", 2048,
              "rows per core call (the token budget of one step)", int),
    EngineArg("prefill_chunk_size", "scheduler", "prefill_chunk_size", 512,
              "prompt tokens per chunk", int),
    EngineArg("mode", "scheduler", "mode", "refill", "decode policy: refill fills rows freed by "
              "early exits with other tokens; no_refill waits for the slowest token",
              choices=MODES),
    EngineArg("prefill_mode", "scheduler", "prefill_mode", "atomic", "prompt policy: atomic "
              "chunks run all loops in one step; per_depth one loop per step; wavefront "
              "pipelines chunks across depths", choices=PREFILL_MODES),
    EngineArg("mixed_prefill_decode", "scheduler", "mixed_prefill_decode", False,
              "put prompt rows (one loop at a time) into the decode core call", bool),
    EngineArg("fill_prompt_chunks", "scheduler", "fill_prompt_chunks", True,
              "cut a new prompt chunk to the rows its core call has left: min(remaining "
              "prompt, rows left, prefill_chunk_size); off: a chunk that does not fit waits "
              "for a later call", bool),
    EngineArg("share_prompts", "scheduler", "share_prompts", True,
              "one prefill for requests with the same prompt and loop settings (the n "
              "choices of a request, group rollouts): the others fork its prompt K/V and "
              "sample their first tokens from its logits", bool),
    EngineArg("max_prefill_batches_before_decode", "scheduler",
              "max_prefill_batches_before_decode", 1,
              "prompt steps in a row before one decode step (when not mixed)", int),
    EngineArg("speculative_tokens", "scheduler", "speculative_tokens", 0, "self-speculative "
              "decoding: up to this many drafted positions in flight per request ahead of "
              "the verified one (0: off)", int),
    EngineArg("draft_loops", "scheduler", "draft_loops", 2, "self-speculative decoding: a "
              "token's draft of the next token is sampled from the coda after this many "
              "loops; the deeper loops verify it", int),
    EngineArg("speculative_max_seqs", "scheduler", "speculative_max_seqs", 32,
              "self-speculative decoding drafts only while at most this many requests run "
              "(a fuller core call has fewer idle rows for drafts to use)", int),
    EngineArg("brownout_waiting_high", "scheduler", "brownout_waiting_high", 0,
              "overload brownout (0: off): when this many requests wait, lower the loop budget "
              "of requests that allow it (SamplingParams.brownout_floor) one level", int),
    EngineArg("brownout_waiting_low", "scheduler", "brownout_waiting_low", 0,
              "brownout: raise the budget one level when at most this many wait", int),
    EngineArg("brownout_step_loops", "scheduler", "brownout_step_loops", 1,
              "brownout: loops taken from max_loops per level", int),
    EngineArg("brownout_max_level", "scheduler", "brownout_max_level", 3,
              "brownout: the deepest level", int),
    EngineArg("brownout_dwell_steps", "scheduler", "brownout_dwell_steps", 16,
              "brownout: engine steps between two level changes (hysteresis in time)", int),
    EngineArg("coda_batching", "scheduler", "coda_batching", "auto", "coda batching in "
              "time: a decode token whose loops exit waits (holding its K/V and state) until "
              "its leave (the coda and lm_head), sampling and next token's prelude run in a "
              "batch with other exited tokens; auto: on for a family whose once-per-token "
              "layers weigh at least half a loop (Huginn) with an exit signal that reads no "
              "logits and synchronous scheduling, off otherwise (Ouro)",
              choices=CODA_BATCHING),
    EngineArg("coda_batch_max_wait", "scheduler", "coda_batch_max_wait", 8, "coda batching: "
              "the most decode calls an exited token waits for its leave", int),
    EngineArg("coda_batch_min_rows", "scheduler", "coda_batch_min_rows", None, "coda "
              "batching: run the leave batch once this many tokens wait (None: once the "
              "calls they waited, summed, reach the family's once-per-token weight in loops "
              "times the running rows)", int),
    EngineArg("exit_mode", "exit", "mode", "ouro", "exit rule: ouro (the trained gate's CDF "
              "against exit_threshold), ouro_delayed, random_lookahead, trace (replay "
              "SamplingParams.exit_trace), criterion (a convergence criterion's score "
              "against exit_threshold each loop: Huginn's, which the default means for it), or "
              "criterion_delayed (exit one loop after the criterion fires: async scheduling)",
              choices=EXIT_MODES),
    EngineArg("lookahead_seed", "exit", "lookahead_seed", 0, "seed of random_lookahead exits", int),
    EngineArg("exit_criterion", "exit", "criterion", "kl", "Huginn: the convergence criterion "
              "a request with exit_threshold < 1 exits by, its exit_threshold the criterion's "
              "threshold (argmax-stability: 5 stable steps); ignored for Ouro",
              choices=("kl", "minp-kl", "entropy-diff", "latent-diff", "cosine",
                       "argmax-stability")),
    EngineArg("prompt_exits", "exit", "prompt_exits", False, "Huginn: a request's whole prompt "
              "exits as one token at the loop its criterion fires (the authors' prompt rule; "
              "needs prefill_mode atomic, whole-prompt chunks and no prefix caching); off: "
              "prompts run all of the request's loops", bool),
    EngineArg("kv_lookup", "exit", "lookup", "last_exited", "Huginn under last_exited: how a "
              "token's step t reads earlier positions that exited before t: last_exited (the "
              "authors' latest-m4: their last step) or full (the authors' default: not at all; "
              "torch attention only)", choices=("last_exited", "full")),
    EngineArg("kv_reservation", "cache", "kv_reservation", "incremental", "incremental: prompt "
              "blocks at admission, grow as positions are written, preempt when short; full: "
              "reserve prompt + max_tokens - 1 positions up front", choices=KV_RESERVATIONS),
    EngineArg("kv_watermark", "cache", "kv_watermark", 0.01, "share of KV blocks admission "
              "keeps free while requests run", float),
    EngineArg("swap_space", "cache", "swap_space", DEFAULT_SWAP_SPACE_BYTES,
              "host bytes for swapped KV blocks (preemption_mode=swap)", int),
    EngineArg("enable_prefix_caching", "cache", "enable_prefix_caching", None, "share full "
              "prompt pages between requests (None: on for last_exited, off for shared)", bool),
    EngineArg("preemption_mode", "scheduler", "preemption_mode", "recompute", "recompute: "
              "replay the prompt and generated tokens at their exit depths; swap: copy KV to "
              "host memory and back", choices=PREEMPTION_MODES),
    EngineArg("scheduling_policy", "scheduler", "scheduling_policy", "fcfs", "priority: a "
              "waiting request with a strictly higher priority (lower value) preempts the "
              "lowest-priority running one when seats or KV are full", choices=SCHEDULING_POLICIES),
    EngineArg("graph_mode", "top", "graph_mode", "auto", "decode core calls through static, "
              "row-bucketed buffers: auto captures CUDA graphs on CUDA and runs eagerly on CPU; "
              "emulate runs the padded static-buffer path without capture (any device); off: "
              "eager", choices=GRAPH_MODES),
    EngineArg("enforce_eager", "top", "enforce_eager", False, "never use CUDA graphs (the same "
              "as --graph-mode off)", bool),
    EngineArg("async_scheduling", "top", "async_scheduling", False, "choose step n+1's rows "
              "while step n executes (needs exit_mode ouro_delayed, random_lookahead, trace or "
              "criterion_delayed)",
              bool),
    EngineArg("init_scale", "top", "init_scale", 0.0, "Huginn: scale of the random initial "
              "state (the authors' default is 1.0), drawn per request from its seed as their "
              "code draws it after torch.manual_seed(seed); 0: zeros", float),
    EngineArg("batch_invariant", "top", "batch_invariant", False, "every row of a core call "
              "gets bits that depend only on its own inputs, never on the other rows of the call "
              "(per-row linears and attention; slower; torch attention, no CUDA graphs)", bool),
    EngineArg("fused_linears", "top", "fused_linears", False, "on CUDA, decode calls of up "
              "to 16 rows run each layer's GEMMs as Triton kernels with the residual adds, "
              "norms, rotary + K/V write and SiLU-and-multiply folded in (5 launches per Ouro "
              "layer instead of 9; off until a GPU measures them against cuBLAS)", bool),
    EngineArg("cascade_attention", "top", "cascade_attention", None, "decode rows of a core "
              "call that share leading KV blocks of one plane (prefix-cache hits) attend over "
              "that prefix once as a group, merged with their own suffix by log-sum-exp (None: "
              "on when prefix caching is on)", bool),
)  # fmt: skip

ENGINE_ARGS_BY_NAME: dict[str, EngineArg] = {arg.name: arg for arg in ENGINE_ARGS}


def default(name: str) -> Any:
    """The default of one engine argument (what the config dataclasses use)."""
    return ENGINE_ARGS_BY_NAME[name].default


def add_engine_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    names: Iterable[str] | None = None,
    defaults: Mapping[str, object] | None = None,
    helps: Mapping[str, str] | None = None,
    title: str = "engine",
) -> None:
    """Add the flags of `names` (all by default) to a new group of `parser`; `defaults` and
    `helps` override some defaults and help texts (a tool that sizes things its own way)."""
    wanted = list(names) if names is not None else [arg.name for arg in ENGINE_ARGS]
    overrides = dict(defaults or {})
    group = (
        parser.add_argument_group(title) if isinstance(parser, argparse.ArgumentParser) else parser
    )
    for name in wanted:
        arg = ENGINE_ARGS_BY_NAME[name]
        value = overrides.get(name, arg.default)
        text = (helps or {}).get(name, arg.help)
        if arg.type is bool:
            # A None default means "decided by other args", a True one "on unless turned
            # off": --flag / --no-flag both exist.
            action = argparse.BooleanOptionalAction if value in (None, True) else "store_true"
            group.add_argument(arg.flag, action=action, default=value, help=text)
            continue
        group.add_argument(arg.flag, type=arg.type, default=value, choices=arg.choices, help=text)


MODEL_ID_ARGS = ("revision", "download_dir")  # what a tool with its own --model also takes


def engine_args_from(
    args: argparse.Namespace, names: Iterable[str] | None = None
) -> dict[str, object]:
    """The `LLM(**engine_args)` keywords of a parsed namespace."""
    wanted = names if names is not None else [arg.name for arg in ENGINE_ARGS]
    return {name: getattr(args, name) for name in wanted}
