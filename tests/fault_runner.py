"""A test-only `ModelRunner` whose per-request setup fails for one seed, and a server on it.

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


def main(argv: list[str]) -> int:
    from loopserve.cli import serve
    from loopserve.engine import llm_engine

    llm_engine.ModelRunner = SetupFaultRunner  # type: ignore[misc]
    return serve.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
