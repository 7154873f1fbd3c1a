"""Model families, chosen from a checkpoint's `config.json`.

A family is a config class, a model class and what loopserve can do with it. The loader and
the engine ask the registry which family a checkpoint belongs to (`model_type` first, then
`architectures`); adding a family means a `models/<family>.py` and one entry here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from loopserve.errors import ConfigError, ModelLoadError
from loopserve.models.config import OuroConfig, read_config_json
from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.models.huginn_config import HUGINN_MODEL_TYPE, HuginnConfig
from loopserve.models.momentum import MOMENTUM_MODEL_TYPE, MomentumConfig, MomentumLoopLM
from loopserve.models.ouro import OuroForLoopedLM


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    config_class: type
    model_class: type[nn.Module]
    tied_head: tuple[str, str]  # (LM head, embedding) tensor names when embeddings are tied
    ignored_tensors: tuple[str, ...]  # checkpoint tensors that are derived, not weights
    engine: bool  # the batched engine serves it
    handoff: bool  # its requests can be handed off between engines (PD disaggregation)
    runs_on: str  # where it runs today, for error messages and docs
    # What its K/V needs from the KV manager besides the planes its config asks for
    # (`config.extra_kv_planes`, the prelude's and coda's once-per-position K/V): prompt pages
    # keyed by the request's loop bound (its prompt K/V depends on it).
    prefix_keyed_by_max_loops: bool = False
    # Its prompts run the request's loop bound rather than the model's D (the prompt's
    # outputs at that bound are what its first token and coda read; deeper loops are waste).
    prompt_loops_by_request: bool = False
    # The exit modes (`loopserve.exit.ExitMode`) its exit signal supports; the first is what
    # the engine's default `exit_mode` ('ouro') means for it.
    exit_modes: tuple[str, ...] = ("ouro", "ouro_delayed", "random_lookahead", "trace")


OURO = ModelFamily(
    name="Ouro",
    model_types=("ouro",),
    architectures=("OuroForCausalLM",),
    config_class=OuroConfig,
    model_class=OuroForLoopedLM,
    tied_head=("lm_head.weight", "model.embed_tokens.weight"),
    ignored_tensors=(),
    engine=True,
    handoff=True,
    runs_on="the engine (LLM, generate, serve, bench, eval, sim)",
)
HUGINN = ModelFamily(
    name="Huginn-0125",
    model_types=(HUGINN_MODEL_TYPE,),
    architectures=("RavenForCausalLM",),
    config_class=HuginnConfig,
    model_class=HuginnForLoopedLM,
    tied_head=("lm_head.weight", "transformer.wte.weight"),
    ignored_tensors=("freqs_cis",),
    engine=True,
    handoff=True,
    prefix_keyed_by_max_loops=True,
    prompt_loops_by_request=True,
    # a convergence criterion's score, not a hazard; its one-loop-delayed variant
    exit_modes=("criterion", "criterion_delayed"),
    runs_on="the engine (eager; the one executor, runner/model_runner.py), the dense reference "
    "(loopserve.models.huginn_dense) and the simulator",
)
MOMENTUM = ModelFamily(  # loopserve's own family that proves the seam (models/momentum.py)
    name="MomentumLoop",
    model_types=(MOMENTUM_MODEL_TYPE,),
    architectures=("MomentumLoopForCausalLM",),
    config_class=MomentumConfig,
    model_class=MomentumLoopLM,
    tied_head=("lm_head.weight", "embed.weight"),
    ignored_tensors=(),
    engine=True,
    handoff=True,
    exit_modes=("ouro", "ouro_delayed", "trace"),  # a hazard, without a lookahead head
    runs_on="the engine (the one executor) and the dense reference (loopserve.reference)",
)
FAMILIES = (OURO, HUGINN, MOMENTUM)


def family_of(raw: dict) -> ModelFamily:
    model_type = raw.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    architectures = set(raw.get("architectures") or ())
    for family in FAMILIES:
        if model_type is None and architectures & set(family.architectures):
            return family
    known = ", ".join(t for family in FAMILIES for t in family.model_types)
    raise ModelLoadError(f"config.json has model_type {model_type!r}; loopserve supports {known}")


def family_of_config(config) -> ModelFamily:
    """The family a parsed config belongs to (its config class)."""
    for family in FAMILIES:
        if isinstance(config, family.config_class):
            return family
    raise ModelLoadError(f"no registered family parses {type(config).__name__}")


def read_config(path: str | os.PathLike):
    """The family and parsed config of a `config.json` (or of a checkpoint directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    raw = read_config_json(path)
    family = family_of(raw)
    return family, family.config_class.from_dict(raw)


DEFAULT_EXIT_MODE = "ouro"  # the engine argument's default


def resolve_exit_mode(family: ModelFamily, mode: str) -> str:
    """The exit mode an engine of `family` runs for the `exit_mode` it was given: the default
    stands for the family's own rule (Huginn: `criterion`); a mode its signal cannot drive
    is a start-up error naming the ones it can."""
    if mode == DEFAULT_EXIT_MODE and mode not in family.exit_modes:
        return family.exit_modes[0]
    if mode not in family.exit_modes:
        raise ConfigError(
            f"{family.name} does not run exit_mode={mode!r}; its exit signal supports "
            + ", ".join(repr(m) for m in family.exit_modes)
        )
    return mode


def require_engine_family(family: ModelFamily) -> None:
    """A clear start-up error for a family the batched engine does not run yet."""
    if not family.engine:
        raise ConfigError(
            f"{family.name} checkpoints load, but the batched engine does not serve this family "
            f"yet; it runs on {family.runs_on}. See docs/model_families.md."
        )
