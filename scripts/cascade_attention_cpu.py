"""Cascade vs plain paged attention for one layer of decode rows that share a prefix.

Run: PYTHONPATH=. python scripts/cascade_attention_cpu.py [--rows 32] [--runs 5]
One core call of `--rows` decode rows of one plane sharing a `--prefix`-position prefix (the
same physical blocks, as prefix-cache hits give), each with its own suffix of 101-400
positions; Ouro-1.4B's attention shape (16 KV heads x 128), float32, block size 16, one torch
thread. Each run times `TorchPagedAttention.attend` plain, cascade, plain, cascade (20 calls
averaged per timing) and checks that the two outputs agree to 1e-4. On a shared machine the
absolute times move with the load; compare within a run.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from loopserve.runner.attention.torch_paged import (
    PagedAttentionMetadata,
    RowSegment,
    TorchPagedAttention,
    Workspace,
)

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 16, 128


def segments_for(rows: int, prefix: int, seed: int) -> tuple[list[RowSegment], int]:
    """Rows sharing blocks 0..prefix/16-1, then own blocks; returns them and blocks used."""
    rng = random.Random(seed)
    prefix_blocks = prefix // BLOCK_SIZE
    next_block, segments = prefix_blocks, []
    for _ in range(rows):
        position = prefix + rng.randrange(100, 400)
        own = -(-(position + 1) // BLOCK_SIZE) - prefix_blocks
        table = list(range(prefix_blocks)) + list(range(next_block, next_block + own))
        next_block += own
        segments.append(RowSegment(table, position, 1))
    return segments, next_block


def time_attend(attention: TorchPagedAttention, tensors, repeats: int = 20) -> float:
    attention.attend(0, *tensors)  # warm the workspace
    start = time.perf_counter()
    for _ in range(repeats):
        attention.attend(0, *tensors)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    segments, num_blocks = segments_for(args.rows, args.prefix, seed=0)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(1, 2, num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    tensors = [torch.randn(args.rows, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in "qkv"]
    scale = HEAD_DIM**-0.5
    calls = {}
    for cascade in (False, True):
        meta = PagedAttentionMetadata.build(segments, BLOCK_SIZE, "cpu", cascade=cascade)
        assert (meta.cascade is not None) == cascade
        calls[cascade] = TorchPagedAttention(cache, meta, scale, Workspace())
    torch.testing.assert_close(
        calls[True].attend(0, *tensors), calls[False].attend(0, *tensors), rtol=1e-4, atol=1e-4
    )
    for run in range(args.runs):
        plain = [time_attend(calls[False], tensors)]
        fast = [time_attend(calls[True], tensors)]
        plain.append(time_attend(calls[False], tensors))
        fast.append(time_attend(calls[True], tensors))
        ratio = sum(plain) / sum(fast)
        print(
            f"run {run}: plain {plain[0] * 1e3:.1f} / {plain[1] * 1e3:.1f} ms, "
            f"cascade {fast[0] * 1e3:.1f} / {fast[1] * 1e3:.1f} ms per layer call, {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
