"""A request as the scheduler tracks it: tokens, KV blocks, progress and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.protocol import SamplingParams, TokenLogprobs


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
    # Overlap scheduling: work already sent in steps whose results have not come back yet.
    num_inflight_tokens: int = 0  # tokens being fed
    num_pending_samples: int = 0  # tokens being sampled (not yet in output_ids)
    epoch: int = 0  # bumped on preemption: in-flight work of an older epoch is void
    slot: int | None = None
    # The worker sampled output_ids[-1] itself and can feed it as the next decode input.
    worker_has_last_token: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    # Host-side timestamps (time.time()) for stats.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_done_time: float | None = None  # the prompt was fully computed for the first time
    # Decode steps delayed by other requests' prefills (--enable-log-request-stats): total seconds,
    # number of delayed stretches, and the last delayed step (a stretch is consecutive steps).
    delayed_seconds: float = 0.0
    delay_count: int = 0
    last_delayed_step: int = -2
    # False once its KV mixes weight versions (weights changed while it ran): its blocks then stay
    # out of the prefix cache. Reset when it is (re)admitted and recomputed from scratch.
    cacheable: bool = True
    # Prompt logprobs (sampling.prompt_logprob_start >= 0) collected so far, from the first wanted token on;
    # sent with the first output token. Kept across preemptions: a re-admission asks only for the rest.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Speculative decoding: steps that verified drafts for it, their draft tokens and the accepted ones.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_fed(self) -> int:
        """Tokens fed to the model, in finished or in-flight steps."""
        return self.num_computed + self.num_inflight_tokens

    @property
    def num_known(self) -> int:
        """Prompt + output tokens, counting those still being sampled."""
        return self.num_tokens + self.num_pending_samples

    @property
    def num_to_feed(self) -> int:
        """Tokens not fed yet (1 for a decode step)."""
        return self.num_known - self.num_fed

    @property
    def num_promised(self) -> int:
        """Output tokens generated or being generated."""
        return len(self.output_ids) + self.num_pending_samples

    def prompt_logprob_next(self) -> int:
        """The first prompt token whose logprob is still to compute (-1: none is): the worker's start."""
        start = self.sampling.prompt_logprob_start
        if start < 0:
            return -1
        nxt = max(start, 1) + len(self.prompt_logprobs)
        return nxt if nxt < len(self.prompt_ids) else -1

    def token_slice(self, start: int, stop: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - n_prompt]
