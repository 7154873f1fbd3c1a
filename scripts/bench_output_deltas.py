"""Output work per step against stream length, "delta" vs "cumulative" outputs.

One request streams NUM_TOKENS tokens of the embedded model's tokenizer (seeded random ids,
one per step, a stop string that never matches so the detokenizer's stop search runs); per
step the engine's output path runs: `detokenize` + `make_output` of a one-token
`RequestDelta`. Prints the thread CPU microseconds per step over the first and the last
WINDOW steps for each output kind, and last/first. Run from the repository root:

    .venv/bin/python scripts/bench_output_deltas.py
"""

from __future__ import annotations

import random
import statistics
import time

from loopserve.engine.llm_engine import DEFAULT_MODEL_DIR
from loopserve.outputs import RequestDelta, TokenLogprob
from loopserve.text.output_processor import OutputProcessor
from loopserve.text.tokenizer import Tokenizer

NUM_TOKENS = 8000
WINDOW = 1000
ROUNDS = 3


def one_stream(tokenizer: Tokenizer, kind: str, ids: list[int]) -> list[float]:
    processor = OutputProcessor(tokenizer)
    prompt = [ids[0]]
    processor.add_request("r", prompt, stop=("zzz-never",), prompt_text=None, output_kind=kind)
    costs = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        delta = RequestDelta(
            request_id="r",
            prompt_token_ids=prompt,
            new_token_ids=[token],
            new_exit_depths=[3],
            new_logprobs=[TokenLogprob(token, -1.0)],
            new_token_times_s=[float(i)],
            num_output_tokens=i + 1,
            finish_reason="length" if last else None,
            stop_token_id=None,
            arrival_s=0.0,
            first_scheduled_s=0.0,
            first_token_s=0.0,
            finished_s=float(i) if last else None,
        )
        start = time.thread_time_ns()
        processor.detokenize("r", delta.new_token_ids)
        processor.make_output(delta)
        costs.append((time.thread_time_ns() - start) / 1000)
    return costs


def main() -> None:
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    assert tokenizer is not None
    rng = random.Random(0)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(NUM_TOKENS)]
    print(f"{NUM_TOKENS} tokens, us of CPU per step (median over {ROUNDS} rounds of window means)")
    print(f"{'kind':<12}{'first ' + str(WINDOW):>14}{'last ' + str(WINDOW):>14}{'last/first':>12}")
    for kind in ("delta", "cumulative"):
        first, last = [], []
        for _ in range(ROUNDS):
            costs = one_stream(tokenizer, kind, ids)
            first.append(statistics.mean(costs[:WINDOW]))
            last.append(statistics.mean(costs[-WINDOW - 1 : -1]))  # the final flush aside
        f, lt = statistics.median(first), statistics.median(last)
        print(f"{kind:<12}{f:>14.1f}{lt:>14.1f}{lt / f:>12.2f}")


if __name__ == "__main__":
    main()
