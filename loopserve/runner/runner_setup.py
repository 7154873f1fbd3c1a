"""The model runner's start-up parts that depend only on the model and its options: the
options the model's math rules out, the model's kernels for this device, the paged K/V
tensor, and the decode slots. `ModelRunner.__init__` calls them in this order."""

from __future__ import annotations

import logging

import torch

from loopserve.errors import ConfigError
from loopserve.models.family import LoopedModel
from loopserve.models.kv_dtype import kv_storage_dtype
from loopserve.runner.batch_invariant import make_batch_invariant
from loopserve.runner.capabilities import unsupported_options
from loopserve.runner.decode_slots import DecodeSlots
from loopserve.runner.loop_calls import CriterionSlots
from loopserve.runner.options import RunnerOptions

logger = logging.getLogger(__name__)


def check_options(model: LoopedModel, options: RunnerOptions) -> None:
    """A start-up error naming every option the model's math rules out."""
    assert not (options.batch_invariant and options.graph_mode != "off"), "graphs pad rows"
    problems = unsupported_options(
        model.signal_kind, graph_mode=options.graph_mode, batch_invariant=options.batch_invariant,
        lookup=options.lookup, layout=options.layout, prompt_exits=options.prompt_exits,
        init_scale=options.init_scale,
    )  # fmt: skip
    if problems:
        raise ConfigError("this model does not run with " + "; ".join(problems))


def prepare_model(model: LoopedModel, options: RunnerOptions) -> None:
    """Give the model the forms it runs here: the row-invariant ones (`batch_invariant`), or
    on CUDA the fused kernels (each residual add and the norms around it, the rotary
    embedding, SiLU-and-multiply: one kernel each, with Triton installed; the CPU torch path
    stays the oracle, tests/test_fused_norms.py, tests/test_fused_ops.py)."""
    on_cuda = model.lm_head.weight.is_cuda
    if options.batch_invariant:
        make_batch_invariant(model)
        model.make_rows_invariant()
    elif options.fused_linears and not on_cuda:
        logger.warning(
            "fused_linears runs on CUDA only; on %s the model runs its torch path",
            model.lm_head.weight.device,
        )
    elif on_cuda:
        try:
            from loopserve.runner.fused_ops import install_fused_kernels
        except ImportError:  # no Triton: the torch ops
            if options.fused_linears:
                logger.warning("fused_linears needs Triton (not installed): the torch ops run")
        else:
            install_fused_kernels(
                model, linears=options.fused_linears, max_positions=options.max_model_len
            )


def make_kv_cache(
    model: LoopedModel, options: RunnerOptions, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The paged K/V of every plane, [layers, K/V, slots, kv_heads, head_dim]; with graphs
    one more block (index `num_blocks`) for padding rows."""
    config = model.config
    blocks = options.num_blocks + (options.graph_mode != "off")
    shape = (model.kv_layers, 2, blocks * options.block_size,
             config.num_key_value_heads, config.head_dim)  # fmt: skip
    return torch.zeros(shape, dtype=kv_storage_dtype(options.kv_cache_dtype, dtype), device=device)


def make_decode_slots(
    model: LoopedModel,
    options: RunnerOptions,
    num_planes: int,
    dtype: torch.dtype,
    device: torch.device,
) -> DecodeSlots:
    """Decode state: one slot per decoding request (its carried state, its criterion's
    fields for a criterion family); its tables' padding is the graphs' dummy block (one
    block past the pool) when graphs run."""
    config = model.config
    max_model_len = options.max_model_len or config.max_position_embeddings
    slots = DecodeSlots(
        options.max_num_seqs, hidden_size=model.state_width,
        once_planes=config.extra_kv_planes, num_planes=num_planes,
        block_size=options.block_size, max_blocks=-(-max_model_len // options.block_size),
        padding_block=options.num_blocks if options.graph_mode != "off" else 0,
        dtype=dtype, device=device,
    )  # fmt: skip
    if model.signal_kind == "criterion":
        slots.criterion = CriterionSlots(
            options.criterion, vocab_size=config.vocab_size,
            threshold=options.criterion_threshold, capacity=options.max_num_seqs,
        )  # fmt: skip
    return slots
