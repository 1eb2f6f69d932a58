"""Control operations over the data-parallel replicas: one ControlRequest from http goes to every replica's
scheduler, and their ControlReplies come back to http combined into one.

Each replica gets its own copy under a sub-id (`{req_id}/dp{d}`; the req_id itself with one replica), so
each reply names the replica that sent it. Once every replica has answered, http gets one ControlReply
under the original req_id:

- success: only if every replica succeeded.
- message: with one replica, its message unchanged. With several, on failure each failing replica's
  message (`replica 1 failed: ...`) and the replicas that succeeded (a weight update is then applied on
  those only); on success the common message if all agree, else each replica's (`replica 0: ...; replica
  1: ...`).
- result: for get_loads, an AllLoads of every replica's Loads, in replica order. For the others, with one
  replica its result unchanged; with several, a WeightIdentity keeps each field that every replica reports
  with the same value (else None: http then applies no version or path), and any other result passes
  through only if every replica's is the same (else None).

InitWeightsUpdateGroup is refused at once with several replicas: every replica's workers would claim
the same ranks in the trainer's group (TokenSpeed requires data-parallel size 1 there as well).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from app.protocol import (
    AllLoads,
    ControlOp,
    ControlReply,
    ControlRequest,
    ControlResult,
    GetLoads,
    InitWeightsUpdateGroup,
    Loads,
    WeightIdentity,
)

log = logging.getLogger(__name__)

SINGLE_REPLICA_ONLY = (InitWeightsUpdateGroup,)


@dataclass
class _Pending:
    op: ControlOp
    replies: list[ControlReply | None] = field(default_factory=list)


class ControlFanOut:
    def __init__(self, num_replicas: int = 1) -> None:
        if num_replicas < 1:
            raise ValueError(f"control fan-out needs at least one replica, not {num_replicas}")
        self.num_replicas = num_replicas
        self._pending: dict[str, _Pending] = {}
        self._sub_ids: dict[str, tuple[str, int]] = {}  # sub-id -> (req_id, replica)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def refusal(self, req: ControlRequest) -> ControlReply | None:
        """The answer to give http at once instead of sending req on, or None to send it."""
        if req.req_id in self._pending:
            return ControlReply(req.req_id, False, f"control request id {req.req_id!r} is already in use")
        if isinstance(req.op, SINGLE_REPLICA_ONLY) and self.num_replicas > 1:
            return ControlReply(req.req_id, False, f"{req.kind} needs --data-parallel-size 1: each of the "
                                f"{self.num_replicas} replicas would take the same ranks in the trainer's group")
        return None

    def split(self, req: ControlRequest) -> list[tuple[int, ControlRequest]]:
        """The copies of req to send, as (replica, request) pairs; their replies go to collect()."""
        self._pending[req.req_id] = _Pending(req.op, [None] * self.num_replicas)
        copies = []
        for replica in range(self.num_replicas):
            sub_id = self._sub_id(req.req_id, replica)
            self._sub_ids[sub_id] = (req.req_id, replica)
            copies.append((replica, ControlRequest(sub_id, req.op)))
        return copies

    def collect(self, reply: ControlReply) -> ControlReply | None:
        """Take one replica's reply; the combined reply once every replica has answered, else None."""
        origin = self._sub_ids.pop(reply.req_id, None)
        if origin is None:
            log.warning("tokenizer: dropping a control reply nobody waits for (%s)", reply.req_id)
            return None
        req_id, replica = origin
        pending = self._pending[req_id]
        pending.replies[replica] = reply
        if any(r is None for r in pending.replies):
            return None
        del self._pending[req_id]
        return combine(req_id, pending.op, [r for r in pending.replies if r is not None])

    def _sub_id(self, req_id: str, replica: int) -> str:
        return req_id if self.num_replicas == 1 else f"{req_id}/dp{replica}"


def combine(req_id: str, op: ControlOp, replies: list[ControlReply]) -> ControlReply:
    """One reply from every replica's, in replica order (the rules in the module docstring)."""
    return ControlReply(req_id, all(r.success for r in replies), _message(replies), _result(op, replies))


def _message(replies: list[ControlReply]) -> str:
    if len(replies) == 1:
        return replies[0].message
    failed = [d for d, r in enumerate(replies) if not r.success]
    if failed:
        parts = [f"replica {d} failed: {replies[d].message or 'no reason given'}" for d in failed]
        succeeded = [str(d) for d, r in enumerate(replies) if r.success]
        if succeeded:
            parts.append(f"succeeded on replica{'s' if len(succeeded) > 1 else ''} {', '.join(succeeded)}")
        return "; ".join(parts)
    if len({r.message for r in replies}) == 1:
        return replies[0].message
    return "; ".join(f"replica {d}: {r.message}" for d, r in enumerate(replies))


def _result(op: ControlOp, replies: list[ControlReply]) -> ControlResult | None:
    results = [r.result for r in replies]
    if isinstance(op, GetLoads):
        return AllLoads([r for r in results if isinstance(r, Loads)])
    if len(results) == 1:
        return results[0]
    identities = [r for r in results if isinstance(r, WeightIdentity)]
    if len(identities) == len(results):
        return WeightIdentity(**{f.name: _agreed([getattr(r, f.name) for r in identities])
                                 for f in dataclasses.fields(WeightIdentity)})
    return _agreed(results)


def _agreed(values: list[Any]) -> Any:
    """The value every replica gave, else None."""
    return values[0] if all(v == values[0] for v in values) else None
