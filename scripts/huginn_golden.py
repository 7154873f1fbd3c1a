"""Golden outputs of the Huginn authors' code for the tiny checkpoint (tests/fixtures).

Runs `raven_modeling_minimal.py` (seal-rg/recurrent-pretraining, `recpre/`; the same file
as the published checkpoint's remote code) on a tiny random checkpoint in the real layout
and writes what it produces: teacher-forced logits at several step counts, greedy tokens of
its fixed-depth generator, and tokens plus steps used of its adaptive generator for every
exit criterion, both cache lookups and both prompt semantics.

It needs an environment with the authors' dependencies, not loopserve's:

    python -m venv /tmp/raven && /tmp/raven/bin/pip install torch==2.13.0 \
        transformers==4.56.0 safetensors
    .venv/bin/python -c "from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint;\
        make_tiny_huginn_checkpoint('/tmp/huginn-tiny')"
    /tmp/raven/bin/python scripts/huginn_golden.py --authors-code PATH/TO/recpre \
        --checkpoint /tmp/huginn-tiny --out tests/fixtures/huginn_golden.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

PROMPT = [5, 17, 99, 3, 42, 7, 64, 11, 90, 23]
STEP_COUNTS = (1, 3, 8)
MAX_NEW_TOKENS = 8
# (criterion, threshold) pairs chosen so that exits spread over several step counts.
CRITERIA = (
    ("none", "auto"),
    ("entropy-diff", 0.03),
    ("latent-diff", 0.1),
    ("cosine", 0.01),
    ("kl", 0.01),
    ("minp-kl", 0.01),
    ("argmax-stability", 2),
)
LOOKUPS = {"full": "full", "latest-m4": "last_exited", "always-last-m4": "always_last"}


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def import_authors_code(directory: Path):
    package = Path(tempfile.mkdtemp()) / "raven_authors"
    package.mkdir()
    for name in ("raven_config_minimal.py", "raven_modeling_minimal.py"):
        shutil.copy(directory / name, package / name)
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(package.parent))
    return importlib.import_module("raven_authors.raven_modeling_minimal")


class RecordingEvaluator:
    """Wraps one of the authors' evaluators and records, per generation step, the value of
    every check and the check at which it first exits."""

    def __init__(self, inner) -> None:
        self.inner, self.records = inner, []

    def init(self, initial_latents):
        self.records.append([0, None, []])
        self.inner.init(initial_latents)

    def check(self, model, latents, aux_inputs):
        exits, outputs, values = self.inner.check(model, latents, aux_inputs)
        record = self.records[-1]
        record[0] += 1
        record[2].append(float(values[0]))
        if record[1] is None and bool(exits[0]):
            record[1] = record[0]
        return exits, outputs, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--authors-code", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    raven = import_authors_code(args.authors_code)
    from transformers import GenerationConfig

    raw = json.loads((args.checkpoint / "config.json").read_text())
    config = raven.RavenConfig(
        n_embd=raw["n_embd"], n_heads=raw["num_attention_heads"],
        n_layers=raw["n_layers"], block_size=raw["block_size"], vocab_size=raw["vocab_size"],
        tie_embeddings=raw["tie_embeddings"], intermediate_size=raw["intermediate_size"],
        bias=raw["bias"], n_layers_in_recurrent_block=raw["n_layers_in_recurrent_block"],
        mean_recurrence=raw["mean_recurrence"], n_layers_in_prelude=raw["n_layers_in_prelude"],
        n_layers_in_coda=raw["n_layers_in_coda"], qk_bias=raw["qk_bias"],
        rope_base=raw["rope_base"], norm_eps=raw["norm_eps"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = raven.RavenForCausalLM(config).eval()
    tensors = load_file(str(args.checkpoint / "model.safetensors"))
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight", "freqs_cis"}, result.missing_keys
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()

    prompt = torch.tensor([PROMPT])
    golden: dict = {"weights_sha256": weights_digest(tensors), "prompt": PROMPT,
                    "max_new_tokens": MAX_NEW_TOKENS, "teacher_forced": {}, "greedy": {},
                    "adaptive": []}  # fmt: skip
    with torch.no_grad():
        for steps in STEP_COUNTS:
            out = model(prompt, num_steps=steps, init_scale=0.0)
            golden["teacher_forced"][str(steps)] = out.logits[0].tolist()
            config_kw = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False}
            tokens = model.generate(
                prompt, GenerationConfig(**config_kw), num_steps=steps, init_scale=0.0,
                continuous_compute=False, max_new_tokens=MAX_NEW_TOKENS,
            )  # fmt: skip
            golden["greedy"][str(steps)] = tokens[0, len(PROMPT) :].tolist()

    max_steps = config.mean_recurrence
    cases = []
    for criterion, threshold in CRITERIA:
        for lookup in LOOKUPS:
            for prefill_exits in (True, False):
                cases.append((criterion, threshold, lookup, prefill_exits, 0, 0.0, None))
    # min_steps, and the seeded random initial state.
    cases.append(("kl", 0.01, "latest-m4", True, 4, 0.0, None))
    cases.append(("kl", 0.01, "latest-m4", True, 0, 1.0, 1234))
    cases.append(("latent-diff", 0.1, "full", False, 0, 1.0, 99))
    for criterion, threshold, lookup, prefill_exits, min_steps, init_scale, seed in cases:
        evaluator = RecordingEvaluator(
            raven.get_adaptive_exit_evaluator(model, criterion, threshold)
        )
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            tokens = model.generate_with_adaptive_compute(
                prompt, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False),
                criterion=criterion, exit_threshold=threshold, init_scale=init_scale,
                cache_lookup_strategy=lookup, do_not_exit_in_prefill=not prefill_exits,
                min_steps=min_steps, exit_evaluator=evaluator, max_new_tokens=MAX_NEW_TOKENS,
            )  # fmt: skip
        steps_used = [
            max_steps if exited_at is None else min_steps + exited_at
            for _, exited_at, _ in evaluator.records
        ]
        golden["adaptive"].append({
            "criterion": criterion, "threshold": None if threshold == "auto" else threshold,
            "lookup": LOOKUPS[lookup], "exit_in_prompt": prefill_exits,
            "min_steps": min_steps, "init_scale": init_scale, "latent_seed": seed,
            "tokens": tokens[0, len(PROMPT) :].tolist(), "steps": steps_used,
            "exit_values": [values for _, _, values in evaluator.records],
        })  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(golden) + "\n")
    print(f"wrote {args.out}: {len(golden['adaptive'])} adaptive cases")


if __name__ == "__main__":
    main()
