"""A request as the scheduler tracks it: tokens, KV blocks, progress and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # KV state: block_ids[i] holds tokens [i*bs, (i+1)*bs); num_computed tokens are in the cache.
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks
    num_computed: int = 0
    slot: int | None = None
    # The worker sampled output_ids[-1] itself and can feed it as the next decode input.
    worker_has_last_token: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    # Host-side timestamps (time.time()) for stats.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet fed to the model (1 for a decode step)."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, stop: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - n_prompt]
