"""Ouro-2.6B's shape end to end on CPU: a random-weight bf16 checkpoint of the config in
tests/fixtures/ouro_2p6b_config.json (the fields of a public copy of the published
config.json), loaded by the engine, its memory plan printed, a few tokens generated.

    python scripts/ouro_2p6b_check.py --dir /tmp/ouro-2p6b [--tokens 4]

About 5.3 GB on disk and 6-11 GB of RAM; minutes on a 2-core CPU. docs/model_families.md
records the last run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "ouro_2p6b_config.json"


def write_checkpoint(out: Path) -> None:
    from loopserve.models.config import OuroConfig
    from loopserve.models.loader import save_model
    from loopserve.models.ouro import OuroForLoopedLM

    raw = json.loads(FIXTURE.read_text())
    config = OuroConfig.from_dict({**raw, "torch_dtype": "bfloat16"})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 5.3 GB, not 10.7
    try:
        model = OuroForLoopedLM(config)  # torch's default initialisation: random weights
    finally:
        torch.set_default_dtype(default)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out, max_shard_bytes=2 * 1024**3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/ouro-2p6b")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    args = parser.parse_args()
    out = Path(args.dir)
    start = time.perf_counter()
    if not (out / "config.json").exists():
        write_checkpoint(out)
    print(f"checkpoint written in {time.perf_counter() - start:.0f} s")
    from loopserve.engine.llm_engine import LLMEngine
    from loopserve.sampling_params import SamplingParams

    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        model=str(out), dtype="bfloat16", num_blocks=64, block_size=16, max_num_seqs=1
    )
    config = engine.model.config
    params = sum(p.numel() for p in engine.model.parameters())
    kv = engine.kv
    print(
        f"loaded in {time.perf_counter() - start:.0f} s: {params / 1e9:.3f}B parameters, "
        f"{config.num_hidden_layers} layers x {config.total_ut_steps} loops; K/V per position "
        f"per plane {config.kv_elements_per_token_per_depth * 2:,} B (bf16), {kv.num_planes} "
        f"planes; {kv.num_blocks} blocks of {kv.bytes_per_block:,} B"
    )
    start = time.perf_counter()
    engine.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(
        max_tokens=args.tokens, temperature=0.0, ignore_eos=True))  # fmt: skip
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (output,) = outputs
    print(
        f"generated {output.token_ids} (loops {output.exit_depths}) in "
        f"{time.perf_counter() - start:.0f} s"
    )
    if not args.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
