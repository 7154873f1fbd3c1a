"""How many splits a decode attention launch uses: the rule the Triton backend applies and
the simulator prices (a launch of more than one split adds the reduce kernel per layer).
Plain Python, no Triton."""

from __future__ import annotations

MIN_SPLIT = 128  # positions: below that the reduce costs more than the parallelism gains


def auto_split_len(
    num_rows: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *, min_split: int = MIN_SPLIT
) -> int:
    """Positions per decode split so that (rows x KV heads x splits) programs fill about two
    waves of `num_sms` multiprocessors, never splitting below `min_split` positions (below
    that the reduce costs more than the parallelism gains). >= max_seq_len means one split."""
    programs = max(1, num_rows * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    splits = max(1, min(wanted, max_seq_len // min_split))
    return -(-max_seq_len // splits) if max_seq_len else min_split


def decode_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of a decode launch of `num_rows` rows whose split length `auto_split_len` picks
    (before the kernel rounds it up to whole key tiles, which can only merge splits)."""
    split_len = auto_split_len(num_rows, num_kv_heads, max_seq_len, num_sms)
    return max(1, -(-max_seq_len // split_len))
