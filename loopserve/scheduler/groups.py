"""Prompt groups: one prefill for requests with the same prompt and loop settings. Torch-free.

The n choices of a request (the server submits them together) and concurrent requests with
the same prompt (an RL group rollout) compute the same prompt K/V in every plane and the
same first-token distribution: only the sampling differs. The first such request to arrive
leads; the others follow it and are not admitted on their own:

- while the leader's prompt runs, followers wait (they count as waiting);
- the step that runs the leader's last prompt position carries the followers' ids
  (`PromptChunk.forks`) and announces them to the executor: it samples each follower's first
  token from the leader's logits with the follower's own sampler (its seed, penalties and
  grammar), so every output equals an independent request's;
- when that step's results come back, each follower forks: its block table shares the
  leader's full prompt blocks and gets a copy of the partly written last block
  (`KVCacheManager.fork`, `KVTransfer(FORK)`), and it decodes from its first token like any
  request. A follower that finds no seat or no blocks then, or whose leader left during that
  step, joins the waiting queue with its first token, as a request preempted by recompute
  does (its prompt runs again, or hits the prefix cache, and decoding resumes).
- A leader that leaves before that step (aborted, failed) hands its group to its oldest
  follower, which joins the waiting queue as the new leader. So do the followers beyond the
  free seats when that step is planned (`max_num_seqs`): the oldest of them leads them, and
  its prompt runs again, from the prefix cache where its pages are cached.

Requests join only with the same prompt ids and the same prompt computation (loop bound,
exit rule, stable steps); requests that score their prompt, replay an exit trace or were
handed off from another engine never join, and neither does any request of an engine that
draws initial states (their prompt K/V depends on each request's seed).
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.scheduler.request import Request

GroupKey = tuple


@dataclass
class GroupStats:
    num_forked: int = 0  # followers that forked (shared a leader's prompt)
    num_unforked: int = 0  # followers that queued with their first token instead


class PromptGroups:
    """Leaders by group key, and each leader's followers: pending (its last prompt position
    not planned yet) or sealed (that step is in flight)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._leader_of_key: dict[GroupKey, str] = {}
        self._key_of_leader: dict[str, GroupKey] = {}
        self.pending: dict[str, list[Request]] = {}  # leader id -> followers, arrival order
        self.sealed: dict[str, list[Request]] = {}  # leader id -> followers of its forks
        self.leader_of: dict[str, str] = {}  # follower id -> leader id
        self.stats = GroupStats()

    @staticmethod
    def key(request: Request) -> GroupKey | None:
        params = request.params
        if (
            params.prompt_logprobs is not None
            or params.exit_trace is not None
            or request.pending_import
            or request.output_token_ids
        ):
            return None
        return (
            tuple(request.prompt_token_ids),
            request.exit_rule,
            request.prompt_loops,
            params.exit_stable_steps,
        )

    def __len__(self) -> int:
        """Followers waiting for their fork (pending and sealed)."""
        return len(self.leader_of)

    def join(self, request: Request) -> bool:
        """Attach a new request to the leader of its group (True), or make it the leader of a
        new group (False: it queues as usual)."""
        key = self.key(request) if self.enabled else None
        if key is None:
            return False
        leader_id = self._leader_of_key.get(key)
        if leader_id is None:
            self._leader_of_key[key] = request.request_id
            self._key_of_leader[request.request_id] = key
            return False
        self.pending.setdefault(leader_id, []).append(request)
        self.leader_of[request.request_id] = leader_id
        return True

    def seal(self, leader_id: str, seats: int) -> tuple[list[Request], Request | None]:
        """The leader's last prompt position is planned: up to `seats` of its pending
        followers fork after this step (returned first, in order). The others form a new
        group whose leader (returned second, for the caller to queue) runs the prompt again
        (from the prefix cache where pages are cached); requests arriving from now on join
        that group, or start one."""
        key = self._key_of_leader.pop(leader_id, None)
        if key is not None:
            del self._leader_of_key[key]
        followers = self.pending.pop(leader_id, [])
        sealed, rest = followers[: max(seats, 0)], followers[max(seats, 0) :]
        if sealed:
            self.sealed.setdefault(leader_id, []).extend(sealed)
        if not rest:
            return sealed, None
        new_leader = rest[0]
        del self.leader_of[new_leader.request_id]
        self._lead(new_leader, rest[1:])
        return sealed, new_leader

    def regroup(self, requests: list[Request]) -> Request | None:
        """Followers that must run their prompt after all (their leader's step ran nothing
        for them): they follow their group's leader if one arrived since, else the first
        leads the others (returned, for the caller to queue)."""
        if not requests:
            return None
        leader_id = self._leader_of_key.get(self.key(requests[0]))
        if leader_id is None:
            self._lead(requests[0], requests[1:])
            return requests[0]
        self.pending.setdefault(leader_id, []).extend(requests)
        for request in requests:
            self.leader_of[request.request_id] = leader_id
        return None

    def _lead(self, leader: Request, followers: list[Request]) -> None:
        """Make `leader` (a former follower) lead `followers` and its key."""
        key = self.key(leader)
        self._leader_of_key[key] = leader.request_id
        self._key_of_leader[leader.request_id] = key
        if followers:
            self.pending[leader.request_id] = followers
            for follower in followers:
                self.leader_of[follower.request_id] = leader.request_id

    def take_sealed(self, leader_id: str) -> list[Request]:
        """The followers whose fork the leader's step just computed (removed from the
        group)."""
        followers = self.sealed.pop(leader_id, [])
        for follower in followers:
            del self.leader_of[follower.request_id]
        return followers

    def leave(self, request: Request) -> list[Request]:
        """`request` finished or left the queue. A follower leaves its group; a leader's
        pending followers are returned (the first to lead them, the caller queues it). A
        leader's sealed followers stay: its step's results still fork them."""
        request_id = request.request_id
        leader_id = self.leader_of.pop(request_id, None)
        if leader_id is not None:
            for followers in (self.pending.get(leader_id), self.sealed.get(leader_id)):
                if followers is not None and request in followers:
                    followers.remove(request)
            return []
        key = self._key_of_leader.pop(request_id, None)
        if key is not None:
            del self._leader_of_key[key]
        orphans = self.pending.pop(request_id, [])
        for follower in orphans:
            del self.leader_of[follower.request_id]
        if orphans:
            self._lead(orphans[0], orphans[1:])
        return orphans[:1]

    def check_invariants(self, requests: dict[str, Request]) -> None:
        followers = [f for group in (*self.pending.values(), *self.sealed.values()) for f in group]
        assert len(followers) == len(self.leader_of), "a follower is in two groups"
        for follower in followers:
            assert follower.request_id in requests, f"{follower.request_id} finished in a group"
        assert set(self._key_of_leader) == set(self._leader_of_key.values())
