"""A test-only `ModelRunner` whose per-request setup fails for one seed, a sampler fault
(`fail_sampling`), and a server on the runner.

`SetupFaultRunner.setup_request` builds the request's state as usual and then raises for a
request seeded `FAIL_SEED` (a seed that passes validation), so a test can fail one request's
setup through an ordinary request, in process or over HTTP. In process, tests put it in place
of `ModelRunner` where `LLMEngine` builds its runner; `python -m tests.fault_runner ARGS` runs
`loopserve serve ARGS` with it (used by `tests/server_utils.ServerProcess`).
"""

from __future__ import annotations

import sys

from loopserve.contracts import NewRequestData
from loopserve.runner.model_runner import ModelRunner, Sampler

FAIL_SEED = 4242
FAULT_TEXT = "injected setup failure"


class SetupFaultRunner(ModelRunner):
    def setup_request(self, new: NewRequestData) -> Sampler:
        state = super().setup_request(new)  # the state is built, then setup fails
        if new.seed == FAIL_SEED:
            raise RuntimeError(f"{FAULT_TEXT} for {new.request_id}")
        return state


FAIL_TOP_K = 13  # `fail_sampling`: requests with this top_k fail in the sampler


def fail_sampling(monkeypatch) -> None:
    """Make the sampler's per-row step raise for requests with `top_k == FAIL_TOP_K` (the
    rows of the same call are sampled as usual)."""
    from loopserve.runner import sampler

    real = sampler.filtered_probs

    def faulty(logits, spec):
        if spec.top_k == FAIL_TOP_K:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, spec)

    monkeypatch.setattr(sampler, "filtered_probs", faulty)


def main(argv: list[str]) -> int:
    from loopserve.cli import serve
    from loopserve.engine import llm_engine

    llm_engine.ModelRunner = SetupFaultRunner  # type: ignore[misc]
    return serve.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
