"""Preemption: victim choice and the recompute replay of generated tokens. Torch-free.

A running request that cannot grow its KV (or, under `scheduling_policy="priority"`, one
outranked by a waiting request) is preempted: the victim is the lowest-priority running
request (largest `priority` value), then the latest arrival. Its KV is freed or swapped to
host memory and it goes back to the waiting queue (sorted by priority, then arrival, so it
precedes everything that arrived after it).

Recompute rebuilds exactly the KV an uninterrupted run holds:
1. the prompt re-runs through the normal prompt policy at full depth, but its last chunk does
   not sample (the first token is known);
2. each generated position t (token `output[t - P]`, fed back at position t) is replayed by
   one-row `REPLAY` items through loops `0..e_t-1`, where `e_t` is the loop count of the token
   it produced; an exit before depth D-1 applies the LAST_EXITED finalize copy, exactly as
   decode did. No coda, no sampling, no gate.
3. the token in flight restarts at loop 0 (the scheduler's `DecodeTable` starts it afresh once
   the replay is done): with identical KV its loops, hazards and exit are recomputed
   identically, and its sampler's generator was never advanced by the replay.

Replay order. LAST_EXITED: position t at depth d reads plane d of every earlier position,
which is final once that position ran loop d or exited (and was finalized). So position t may
run depth d when every earlier unfinished position has already run depth d — a wavefront over
positions: a replay of n tokens takes about n + D steps, and its rows ride in decode calls
next to other requests. SHARED: every position reads the final K/V of earlier positions, so
replay is strictly position-major (one position through all its loops, then the next).
"""

from __future__ import annotations

from loopserve.scheduler.request import Request


def pick_victim(candidates: list[Request]) -> Request:
    """Lowest priority (largest value), then latest arrival."""
    return max(candidates, key=lambda r: (r.params.priority, r.arrival_order))


def reset_for_recompute(request: Request) -> None:
    """Forget all device-side progress; keep the tokens, exit depths and sampler state."""
    request.num_prefilled_tokens = 0
    request.next_chunk_start = 0
    request.prompt_chunks = []
    request.replay = None
    request.spec = None  # its positions in flight restart from the last final token
    request.num_hit_positions = 0
    if not request.output_token_ids:  # preempted mid-prompt: its prompt is scored again
        request.prompt_logprobs.clear()
