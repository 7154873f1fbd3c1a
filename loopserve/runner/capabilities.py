"""What the one executor can run for a model: the options its math rules out, named.

The runner reads a model only through its math (`models/family.py`, `LoopedModel`), so what
it cannot run follows from that math (its exit-signal kind, its once planes), never from the
family's name. `LLMEngine` turns the list into one start-up error naming every option, and
resolves `graph_mode` auto from it.
"""

from __future__ import annotations


def unsupported_options(
    signal_kind: str,
    *,
    graph_mode: str = "off",
    speculative: bool = False,
    batch_invariant: bool = False,
    lookup: str = "last_exited",
    layout: str = "last_exited",
    attention_backend: str = "torch",
    prompt_exits: bool = False,
    chunked_or_mixed_prompts: bool = False,
    prefix_caching: bool = False,
    init_scale: float = 0.0,
) -> list[str]:
    """The options this runner cannot run for a model whose exit signal is of `signal_kind`
    (`LoopedModel.signal_kind`: it is known from the checkpoint's family before any weight is
    read, so `loopserve serve` checks it before it binds a port), each named (empty: it runs
    them all). The decode graphs and speculation run every family, but not drawn initial
    states or the `full` lookup; `kv_lookup='full'` needs per-position masks (the torch
    backend, eager, LAST_EXITED); `prompt_exits` needs a criterion signal and the whole prompt in one step."""
    problems = []
    criterion = signal_kind == "criterion"
    if graph_mode != "off" and init_scale > 0:
        problems.append(
            f"graph_mode={graph_mode!r} with init_scale > 0 (initial states are drawn per "
            "request on the host: graph_mode='off')"
        )
    if graph_mode != "off" and lookup == "full":
        problems.append(f"graph_mode={graph_mode!r} with kv_lookup='full' (per-step masks)")
    if speculative and init_scale > 0:
        problems.append(
            "speculative_tokens > 0 with init_scale > 0 (a rolled-back position would draw "
            "its initial state again)"
        )
    if speculative and lookup == "full":
        problems.append("speculative_tokens > 0 with kv_lookup='full' (per-step masks)")
    if lookup == "full":
        if batch_invariant:
            problems.append(
                "batch_invariant=True with kv_lookup='full' (row-invariant attention has no "
                "per-step masks)"
            )
        if layout != "last_exited":
            problems.append("kv_lookup='full' outside layout='last_exited'")
        if attention_backend != "torch":
            problems.append(
                f"kv_lookup='full' on the {attention_backend} attention backend (torch only)"
            )
    if prompt_exits:
        if not criterion:
            problems.append("prompt_exits=True (it reads a convergence criterion)")
        if chunked_or_mixed_prompts:
            problems.append("prompt_exits=True outside prefill_mode='atomic' without mixing")
        if prefix_caching:
            problems.append("prompt_exits=True with prefix caching (pass it off)")
    return problems
