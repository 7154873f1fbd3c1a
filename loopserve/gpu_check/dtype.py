"""How far a low-precision run (bf16/fp16) drifts from float32 on the same workload.

Runs one seeded workload (random prompt token ids, greedy, Ouro exit rule at a threshold so
exit depths vary) through the engine twice, in float32 and in the low-precision dtype, and
compares every request's output tokens and exit depths. Reports the share of requests whose
tokens differ, whose exit depths differ, and where the first divergence happens (output token
index, and whether a token or an exit depth diverged first). No pass/fail: the numbers are
recorded in docs/gpu.md.

    PYTHONPATH=. python -m loopserve.gpu_check.dtype --model tiny --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from dataclasses import asdict, dataclass

from loopserve.llm import LLM
from loopserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Divergence:
    model: str
    dtype: str
    device: str
    num_requests: int
    max_tokens: int
    exit_threshold: float
    tokens_differ_share: float  # requests whose output token ids differ anywhere
    depths_differ_share: float  # requests whose exit depths differ anywhere
    any_differ_share: float
    first_divergence: list[int]  # per diverging request: first output index that differs
    first_by_depth_share: float  # of diverging requests: an exit depth diverged first (alone)
    mean_loops_fp32: float

    def summary(self) -> str:
        first = self.first_divergence
        where = (
            f"first divergence at output token min {min(first)}, median "
            f"{statistics.median(first):g}, max {max(first)}; exit depth alone first in "
            f"{self.first_by_depth_share:.0%} of them"
            if first
            else "no divergence"
        )
        return (
            f"{self.model} {self.dtype} vs float32 on {self.device}: {self.num_requests} requests "
            f"x {self.max_tokens} tokens, threshold {self.exit_threshold}: tokens differ in "
            f"{self.tokens_differ_share:.1%}, exit depths in {self.depths_differ_share:.1%}, "
            f"either in {self.any_differ_share:.1%}; {where}; mean loops (fp32) "
            f"{self.mean_loops_fp32:.2f}"
        )


def workload(seed: int, num_requests: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 65))]
        for _ in range(num_requests)
    ]


def measure(
    model_dir: str,
    *,
    name: str,
    dtype: str = "bfloat16",
    device: str = "cpu",
    num_requests: int = 32,
    max_tokens: int = 32,
    exit_threshold: float = 0.5,
    seed: int = 0,
    attention_backend: str = "auto",
) -> Divergence:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, exit_threshold=exit_threshold, ignore_eos=True
    )
    outputs = {}
    for run_dtype in ("float32", dtype):
        llm = LLM(model_dir, dtype=run_dtype, device=device, attention_backend=attention_backend)
        prompts = workload(seed, num_requests, llm.engine.model.config.vocab_size)
        outputs[run_dtype] = llm.generate(prompts, params, use_tqdm=False)
    tokens_differ = depths_differ = by_depth = 0
    first: list[int] = []
    for ref, low in zip(outputs["float32"], outputs[dtype]):
        tokens_differ += ref.token_ids != low.token_ids
        depths_differ += ref.exit_depths != low.exit_depths
        pairs = list(zip(ref.token_ids, ref.exit_depths, low.token_ids, low.exit_depths))
        for index, (t_ref, d_ref, t_low, d_low) in enumerate(pairs):
            if (t_ref, d_ref) != (t_low, d_low):
                first.append(index)
                by_depth += t_ref == t_low
                break
    total_loops = sum(sum(o.exit_depths) for o in outputs["float32"])
    total_tokens = sum(len(o.exit_depths) for o in outputs["float32"])
    return Divergence(
        model=name,
        dtype=dtype,
        device=device,
        num_requests=num_requests,
        max_tokens=max_tokens,
        exit_threshold=exit_threshold,
        tokens_differ_share=tokens_differ / num_requests,
        depths_differ_share=depths_differ / num_requests,
        any_differ_share=len(first) / num_requests,
        first_divergence=first,
        first_by_depth_share=by_depth / len(first) if first else 0.0,
        mean_loops_fp32=total_loops / total_tokens,
    )


def model_dir_for(name: str, workdir: str) -> str:
    """`tiny` (tests' tiny checkpoint), `default` (the embedded model), `medium` (a random
    hidden-512, 8-layer, 8-head checkpoint), or a checkpoint path."""
    from loopserve.models.tiny import DEFAULT_MODEL_DIR, make_tiny_checkpoint

    if name == "tiny":
        return str(make_tiny_checkpoint(f"{workdir}/tiny", seed=0))
    if name == "default":
        return str(DEFAULT_MODEL_DIR)
    if name == "medium":
        return str(
            make_tiny_checkpoint(
                f"{workdir}/medium",
                hidden_size=512,
                num_layers=8,
                num_heads=8,
                num_kv_heads=8,
                vocab_size=4096,
                seed=0,
            )
        )
    return name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | default | medium | a path")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--exit-threshold", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        result = measure(
            model_dir_for(args.model, workdir),
            name=args.model,
            dtype=args.dtype,
            device=args.device,
            num_requests=args.num_requests,
            max_tokens=args.max_tokens,
            exit_threshold=args.exit_threshold,
            seed=args.seed,
        )
    if args.json:
        import json

        print(json.dumps(asdict(result)))
    else:
        print(result.summary())


if __name__ == "__main__":
    main()
