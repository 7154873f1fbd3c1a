"""Huginn-0125 against the authors' code: golden outputs of `raven_modeling_minimal.py` for a
tiny checkpoint in the published layout (tests/fixtures/huginn_golden.json, made by
scripts/huginn_golden.py), the loader, the family registry and the exit criteria."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopserve.errors import ConfigError, ModelLoadError
from loopserve.exit.criteria import CRITERIA, make_criterion
from loopserve.models import load_model
from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.models.huginn_config import HuginnConfig
from loopserve.models.huginn_dense import generate, teacher_forced_logits
from loopserve.models.huginn_dense import step_logits as every_step_logits
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint, weights_digest
from loopserve.models.registry import (
    HUGINN,
    OURO,
    family_of,
    read_config,
    require_engine_family,
)

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "huginn_golden.json").read_text())


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


@pytest.fixture(scope="module")
def huginn(huginn_dir):
    return load_model(huginn_dir, dtype="float32")


def test_golden_file_was_made_from_these_weights(huginn_dir):
    assert (
        weights_digest(load_file(str(huginn_dir / "model.safetensors")))
        == (GOLDEN["weights_sha256"])
    )


@pytest.mark.parametrize("steps", sorted(GOLDEN["teacher_forced"]))
def test_teacher_forced_logits_equal_the_authors(huginn, steps):
    ours = teacher_forced_logits(huginn, GOLDEN["prompt"], num_steps=int(steps))
    theirs = torch.tensor(GOLDEN["teacher_forced"][steps])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_every_step_logits_equal_a_run_of_that_many_steps(huginn):
    """`step_logits` (every step's logits of one run, which `bench speculative` reads for
    its stable-loop distribution) equals `teacher_forced_logits` at each step count."""
    prompt = GOLDEN["prompt"]
    every = every_step_logits(huginn, prompt, num_steps=5)
    assert len(every) == 5
    for steps, logits in enumerate(every, start=1):
        assert torch.equal(logits, teacher_forced_logits(huginn, prompt, num_steps=steps)), steps


@pytest.mark.parametrize("steps", sorted(GOLDEN["greedy"]))
def test_fixed_depth_greedy_tokens_equal_the_authors(huginn, steps):
    out = generate(huginn, GOLDEN["prompt"], max_new_tokens=GOLDEN["max_new_tokens"],
                   num_steps=int(steps))  # fmt: skip
    assert out.tokens == GOLDEN["greedy"][steps]
    assert out.steps == [int(steps)] * len(out.tokens)


def _case_id(case: dict) -> str:
    parts = [case["criterion"], case["lookup"], "prompt-exits" if case["exit_in_prompt"] else
             "prompt-full", f"min{case['min_steps']}", f"seed{case['latent_seed']}"]  # fmt: skip
    return "-".join(parts)


@pytest.mark.parametrize("case", GOLDEN["adaptive"], ids=_case_id)
def test_adaptive_generation_equals_the_authors(huginn, case):
    out = generate(
        huginn, GOLDEN["prompt"], max_new_tokens=GOLDEN["max_new_tokens"],
        criterion=case["criterion"], threshold=case["threshold"], lookup=case["lookup"],
        exit_in_prompt=case["exit_in_prompt"], min_steps=case["min_steps"],
        init_scale=case["init_scale"], latent_seed=case["latent_seed"],
    )  # fmt: skip
    assert (out.tokens, out.steps) == (case["tokens"], case["steps"])
    assert [len(v) for v in out.exit_values] == [len(v) for v in case["exit_values"]]
    for ours, theirs in zip(out.exit_values, case["exit_values"], strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-3,
                                   atol=1e-5, equal_nan=True)  # fmt: skip


def test_the_golden_cases_discriminate():
    """The fixture can catch a wrong lookup, a wrong criterion or a wrong prompt rule: the
    authors' outputs differ along each of those axes."""
    cases = GOLDEN["adaptive"]
    by_key = {(c["criterion"], c["lookup"], c["exit_in_prompt"]): c for c in cases
              if c["min_steps"] == 0 and c["latent_seed"] is None}  # fmt: skip
    lookups_differ = [k for k, c in by_key.items() if k[1] == "full" and
                      c["tokens"] != by_key[(k[0], "last_exited", k[2])]["tokens"]]  # fmt: skip
    assert len(lookups_differ) >= 3
    assert len({tuple(c["steps"]) for c in cases}) >= 10
    assert len({s for c in cases for s in c["steps"]}) >= 6  # exits at many step counts


def test_random_initial_state_is_reproducible_per_seed(huginn):
    kwargs = {"max_new_tokens": 4, "criterion": "kl", "threshold": 0.01, "init_scale": 1.0}
    first = generate(huginn, GOLDEN["prompt"], latent_seed=7, **kwargs)
    again = generate(huginn, GOLDEN["prompt"], latent_seed=7, **kwargs)
    assert (first.tokens, first.steps) == (again.tokens, again.steps)
    torch.testing.assert_close(torch.stack(first.logits), torch.stack(again.logits), rtol=0, atol=0)
    other = generate(huginn, GOLDEN["prompt"], latent_seed=8, **kwargs)
    assert not torch.equal(torch.stack(first.logits), torch.stack(other.logits))


def test_loader_reads_the_published_layout(huginn, huginn_dir, tmp_path):
    assert isinstance(huginn, HuginnForLoopedLM)
    assert huginn.lm_head.weight is huginn.transformer.wte.weight
    family, config = read_config(huginn_dir)
    assert family is HUGINN and isinstance(config, HuginnConfig)
    # The authors' checkpoints carry the RoPE table as a tensor and may store the tied head.
    tensors = load_file(str(huginn_dir / "model.safetensors"))
    tensors["freqs_cis"] = torch.zeros(1, 256, 1, 4, 2)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    (tmp_path / "config.json").write_text((huginn_dir / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    again = load_model(tmp_path, dtype="float32")
    torch.testing.assert_close(again.lm_head.weight, huginn.lm_head.weight)


def test_loader_names_the_family_in_its_errors(huginn_dir, tmp_path):
    tensors = load_file(str(huginn_dir / "model.safetensors"))
    del tensors["transformer.adapter.weight"]
    (tmp_path / "config.json").write_text((huginn_dir / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="Huginn-0125 architecture.*transformer.adapter"):
        load_model(tmp_path)
    raw = json.loads((huginn_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="injection_type"):
        HuginnConfig.from_dict({**raw, "injection_type": "add"})


def test_registry_picks_the_family_from_config():
    assert family_of({"model_type": "ouro"}) is OURO
    assert family_of({"model_type": "huginn_raven"}) is HUGINN
    assert family_of({"architectures": ["RavenForCausalLM"]}) is HUGINN
    with pytest.raises(ModelLoadError, match="model_type 'llama'.*ouro, huginn_raven"):
        family_of({"model_type": "llama", "architectures": ["RavenForCausalLM"]})


def test_a_family_the_engine_does_not_serve_is_a_start_up_error():
    family = dataclasses.replace(HUGINN, engine=False, runs_on="the dense reference")
    with pytest.raises(ConfigError, match="Huginn-0125 checkpoints load, but the batched engine"):
        require_engine_family(family)
    require_engine_family(HUGINN)  # served


@pytest.mark.parametrize("name", CRITERIA)
def test_criteria_treat_tokens_independently(name):
    """A criterion over several tokens at once decides each as it would alone (the batched
    engine checks many tokens per core call)."""
    generator = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 1, 16, generator=generator) for _ in range(4)]
    logits = [torch.randn(3, 50, generator=generator) * 3 for _ in range(4)]
    together = make_criterion(name, vocab_size=50)
    initial = torch.randn(3, 1, 16, generator=torch.Generator().manual_seed(1))
    together.init(initial)
    alone = [make_criterion(name, vocab_size=50) for _ in range(3)]
    for row, rule in enumerate(alone):
        rule.init(initial[row : row + 1])
    for latents, step_logits in zip(steps, logits, strict=True):
        exits, values = together.check(latents, step_logits)
        for row, rule in enumerate(alone):
            row_exits, row_values = rule.check(latents[row : row + 1], step_logits[row : row + 1])
            assert bool(exits[row]) == bool(row_exits[0])
            torch.testing.assert_close(values[row : row + 1], row_values, equal_nan=True)


def test_unknown_criterion_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown exit criterion 'entropy'.*kl"):
        make_criterion("entropy", vocab_size=8)
