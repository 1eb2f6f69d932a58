"""Which data-parallel replica serves each request (--data-parallel-size, --load-balance-method).

Every request passes through the tokenizer, so it routes them: a new request goes to one replica's
scheduler and stays there; its follow-ups (an abort, a stop-string finish) go to the same replica.
The router counts the unfinished requests it has sent to each replica, from routing until the
tokenizer drops the request (its terminal delta, a stop-string match, a failure here).

Methods (TokenSpeed's names):
- shortest_queue: the replica with the fewest unfinished requests routed to it; ties go to the
  lowest index.
- round_robin: replicas in turn, 0, 1, ..., N-1, 0, ...

Fan-out siblings (OpenAI n > 1 runs as rids `{id}-{index}`, one per sample) with the same prompt go to
the replica of a live sibling, so a later one can reuse the first one's prefix cache; that choice does not
advance the round-robin turn. Routing never affects correctness: any replica can serve any request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

LOAD_BALANCE_METHODS = ("shortest_queue", "round_robin")

_SIBLING = re.compile(r"(.+)-\d+")  # a fan-out child's rid: {parent id}-{index}

GroupKey = tuple[str, int]  # (parent id, hash of the prompt ids)


@dataclass(slots=True)
class _Group:
    replica: int
    live: int


class Router:
    def __init__(self, num_replicas: int = 1, method: str = "shortest_queue") -> None:
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, not {num_replicas}")
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"unknown --load-balance-method {method!r}: use one of {', '.join(LOAD_BALANCE_METHODS)}")
        self.num_replicas = num_replicas
        self.method = method
        self._load = [0] * num_replicas
        self._where: dict[str, tuple[int, GroupKey | None]] = {}
        self._groups: dict[GroupKey, _Group] = {}
        self._turn = 0

    @property
    def loads(self) -> list[int]:
        """Unfinished requests routed to each replica."""
        return list(self._load)

    def route(self, rid: str, prompt_ids: Sequence[int]) -> int:
        """Choose the replica for a new request and remember it until release(rid)."""
        if rid in self._where:
            raise ValueError(f"request id {rid!r} is already routed")
        key = _group_key(rid, prompt_ids) if self.num_replicas > 1 else None
        group = self._groups.get(key) if key is not None else None
        if group is not None:
            group.live += 1
            replica = group.replica
        else:
            replica = self._pick()
            if key is not None:
                self._groups[key] = _Group(replica, 1)
        self._where[rid] = (replica, key)
        self._load[replica] += 1
        return replica

    def replica_of(self, rid: str) -> int | None:
        """The replica holding rid, or None if it is not (or no longer) routed."""
        entry = self._where.get(rid)
        return entry[0] if entry is not None else None

    def release(self, rid: str) -> None:
        """rid is over: it no longer counts against its replica (unknown rids are ignored)."""
        entry = self._where.pop(rid, None)
        if entry is None:
            return
        replica, key = entry
        self._load[replica] -= 1
        if key is not None:
            group = self._groups[key]
            group.live -= 1
            if group.live == 0:
                del self._groups[key]

    def _pick(self) -> int:
        if self.method == "round_robin":
            replica = self._turn
            self._turn = (self._turn + 1) % self.num_replicas
            return replica
        return min(range(self.num_replicas), key=self._load.__getitem__)  # min keeps the lowest index on ties


def _group_key(rid: str, prompt_ids: Sequence[int]) -> GroupKey | None:
    match = _SIBLING.fullmatch(rid)
    return (match.group(1), hash(tuple(prompt_ids))) if match is not None else None
