"""Routing for data-parallel replicas: which replica gets a submission.

Pure bookkeeping, no Ray and no torch, so it is tested on its own. The pool tells the router
what it routed and what finished; the router keeps each replica's **outstanding work** in
tokens: for every request routed there and not finished, its prompt tokens until its first
output token arrives (the prefill still to do), plus the tokens it may still generate
(`max_tokens` minus those generated).

Policies (chosen once, at construction):

- `least_load` (default): the serving replica with the least outstanding work; ties go to
  the lowest index.
- `prefix`: requests whose prompts share their first full KV blocks go to the replica that
  served that prefix last, so its prefix cache hits. Prefix keys are chained hashes of the
  token ids of each full block (`block_size` tokens), the same keying a paged prefix cache
  uses; the longest known prefix wins. When that replica is much busier than the least loaded
  one (more than `balance_abs_tokens` more outstanding tokens AND more than
  `balance_rel` times as many), the request goes by load instead. Prompts shorter than one
  block route by load. The table is an LRU bounded by `max_prefix_entries`.

Streamed hand-offs (prefill/decode disaggregation, `--kv-handoff stream`) reserve their
blocks on a decode replica before the prompt runs, and their chunks then arrive over that
replica's link while the prompt computes. `choose_handoff` picks the decode replica with the
fewest streamed hand-offs in flight (reserved and not yet imported: `begin_handoffs`,
`end_handoff`), then the least outstanding work: two long prompts streaming to one replica
share its link, and their chunks queue behind each other past their first tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from loopserve.scheduler.prefix_cache import prefix_block_hashes

ROUTING_POLICIES = ("least_load", "prefix")
DEFAULT_BALANCE_ABS_TOKENS = 2048
DEFAULT_BALANCE_REL = 2.0
DEFAULT_MAX_PREFIX_ENTRIES = 65536


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """What the router needs to know about one request of a submission."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: int
    prefix_hit: bool  # routed by a known prefix (not by load)


@dataclass(slots=True)
class _Outstanding:
    replica: int
    prompt_tokens: int  # still counted until the first output token
    remaining_tokens: int


@dataclass
class Router:
    """Tracks outstanding work per replica and picks replicas; see the module docstring."""

    num_replicas: int
    policy: str = "least_load"
    block_size: int = 16
    balance_abs_tokens: int = DEFAULT_BALANCE_ABS_TOKENS
    balance_rel: float = DEFAULT_BALANCE_REL
    max_prefix_entries: int = DEFAULT_MAX_PREFIX_ENTRIES
    _loads: list[int] = field(init=False)
    _handoffs: list[int] = field(init=False)  # streamed hand-offs in flight, per replica
    _requests: dict[str, _Outstanding] = field(init=False, default_factory=dict)
    _prefixes: OrderedDict[bytes, int] = field(init=False, default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.policy!r}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        self._loads = [0] * self.num_replicas
        self._handoffs = [0] * self.num_replicas

    # ---- queries ------------------------------------------------------------------------

    def load(self, replica: int) -> int:
        """Outstanding tokens on `replica`."""
        return self._loads[replica]

    def choose(
        self, serving: Sequence[int], prompt_token_ids: Sequence[int] | None
    ) -> RouteDecision:
        """The replica for a submission whose first prompt is `prompt_token_ids` (None when
        unknown), among the `serving` replica indices (non-empty)."""
        assert serving, "no serving replica to route to"
        least = min(serving, key=lambda r: (self._loads[r], r))
        if self.policy != "prefix" or not prompt_token_ids:
            return RouteDecision(least, False)
        for key in reversed(prefix_block_hashes(prompt_token_ids, self.block_size)):
            owner = self._prefixes.get(key)
            if owner is not None and owner in serving:
                if self._much_busier(owner, least):
                    return RouteDecision(least, False)
                return RouteDecision(owner, True)
        return RouteDecision(least, False)

    def handoffs(self, replica: int) -> int:
        """Streamed hand-offs reserved on `replica` and not yet imported."""
        return self._handoffs[replica]

    def choose_handoff(self, serving: Sequence[int]) -> int:
        """The decode replica, among `serving` (non-empty), for a streamed hand-off's
        reservation: the fewest streamed hand-offs in flight, then the least outstanding
        work, then the lowest index."""
        assert serving, "no serving replica to route to"
        return min(serving, key=lambda r: (self._handoffs[r], self._loads[r], r))

    def _much_busier(self, replica: int, least: int) -> bool:
        load, min_load = self._loads[replica], self._loads[least]
        return load - min_load > self.balance_abs_tokens and load > self.balance_rel * min_load

    # ---- bookkeeping --------------------------------------------------------------------

    def assign(
        self,
        replica: int,
        requests: Sequence[RoutedRequest],
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        """Record that `requests` now run on `replica`; remember the prompt's prefix there."""
        for request in requests:
            entry = _Outstanding(replica, request.num_prompt_tokens, request.max_tokens)
            self._requests[request.request_id] = entry
            self._loads[replica] += entry.prompt_tokens + entry.remaining_tokens
        if self.policy == "prefix" and prompt_token_ids:
            for key in prefix_block_hashes(prompt_token_ids, self.block_size):
                self._prefixes[key] = replica
                self._prefixes.move_to_end(key)
            while len(self._prefixes) > self.max_prefix_entries:
                self._prefixes.popitem(last=False)

    def begin_handoffs(self, replica: int, count: int) -> None:
        """`count` streamed hand-offs were reserved on `replica`."""
        self._handoffs[replica] += count

    def end_handoff(self, replica: int) -> None:
        """A streamed hand-off reserved on `replica` was imported there or released."""
        self._handoffs[replica] = max(0, self._handoffs[replica] - 1)

    def progress(self, request_id: str, num_new_tokens: int) -> None:
        """`num_new_tokens` more output tokens arrived for `request_id`."""
        entry = self._requests.get(request_id)
        if entry is None or num_new_tokens <= 0:
            return
        done = entry.prompt_tokens + min(num_new_tokens, entry.remaining_tokens)
        entry.prompt_tokens = 0
        entry.remaining_tokens -= min(num_new_tokens, entry.remaining_tokens)
        self._loads[entry.replica] -= done

    def finish(self, request_id: str) -> None:
        """The request finished, failed or was aborted: its work is no longer outstanding."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self._loads[entry.replica] -= entry.prompt_tokens + entry.remaining_tokens

    def forget_replica(self, replica: int) -> None:
        """The replica restarted with an empty cache: drop its prefixes."""
        for key in [k for k, owner in self._prefixes.items() if owner == replica]:
            del self._prefixes[key]
