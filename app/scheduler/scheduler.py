"""Continuous batching: which tokens of which requests run in each step.

Policy (per step, within a token budget of --chunked-prefill-size, or --max-prefill-tokens
when chunking is off):
1. Running requests first, in admission order: decodes (1 token each) and the next chunk of
   partially prefilled prompts. Decodes therefore never starve behind new prefills.
2. If a running request needs a block and none is free, the most recently admitted running
   request that is not yet in this step is preempted (its blocks released, its progress
   recomputed later from prompt + generated tokens); it goes back to the head of the queue,
   so its output is unchanged and it cannot wait forever.
3. Then waiting requests in arrival order (FCFS), reusing prefix-cached blocks, while budget,
   --max-num-seqs and free blocks allow. The head of the queue is never skipped.
Overlap: the scheduler may plan step N+1 before step N's result is back (the process loop keeps
two steps in flight). A decode fed by a token still being sampled carries no token ids: the
worker feeds the token it sampled itself. A request that turns out to have finished at step N
wastes its slot in step N+1 (that result is ignored); length limits are known ahead and never
over-scheduled.
Prompt logprobs: a request that asks takes no prefix-cache hit past the first position they need (a
cached prefix has no hidden states: it is recomputed); the worker's per-step lists are collected and
sent once, with the first output token; after a preemption only the missing ones are asked again.
No torch here: the scheduler reasons about token ids and block ids only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app import protocol as p
from app.config.settings import Settings
from app.scheduler.kv_cache import KVCacheManager, chain_hash
from app.scheduler.request import Request, Status

if TYPE_CHECKING:
    from app.metrics.kv_events import KVEventRecorder

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    chunked_prefill_size: int  # -1: no chunking
    max_prefill_tokens: int
    enable_prefix_caching: bool
    eos_token_ids: tuple[int, ...]
    # Admission control and timeouts (None: unbounded / off). See expire() and add_request().
    max_queued_requests: int | None = None
    request_timeout: float | None = None
    ttft_timeout: float | None = None
    # Speculative decoding: draft tokens a decode step may verify (0: off); see _draft_len.
    num_speculative_tokens: int = 0

    @classmethod
    def from_settings(cls, settings: Settings, ready: p.WorkerReady) -> SchedulerConfig:
        """The scheduler's knobs from the appliance settings and the worker's pool figures."""
        return cls(
            num_blocks=ready.num_blocks,
            block_size=ready.block_size,
            max_model_len=ready.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            chunked_prefill_size=settings.chunked_prefill_size,
            max_prefill_tokens=settings.max_prefill_tokens,
            enable_prefix_caching=settings.enable_prefix_caching,
            eos_token_ids=tuple(ready.eos_token_ids),
            max_queued_requests=settings.max_queued_requests,
            request_timeout=settings.request_timeout,
            ttft_timeout=settings.ttft_timeout,
            num_speculative_tokens=settings.speculative_num_steps if settings.speculative_algorithm else 0,
        )

    @property
    def chunking(self) -> bool:
        return self.chunked_prefill_size > 0

    @property
    def token_budget(self) -> int:
        return self.chunked_prefill_size if self.chunking else self.max_prefill_tokens

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


class AdmissionError(ValueError):
    """A request that can never run under this configuration (HTTP 400)."""


class QueueFull(Exception):
    """The scheduler holds --max-num-seqs + --max-queued-requests requests already (HTTP 503)."""


@dataclass(slots=True)
class StepCounters:
    """What happened since the metrics last took them (see Scheduler.take_counters)."""

    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # of those, served from the cache
    queue_times: list[float] = field(default_factory=list)  # arrival -> first scheduled, seconds
    # Speculative decoding: verify rows that drafted, their draft tokens, and the accepted ones.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps accepting draft i+1


# Called when a request ends: (request, finish reason); the request was aborted iff the reason is abort.
FinishHook = Callable[[Request, str], None]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_events: KVEventRecorder | None = None) -> None:
        if not config.chunking and config.max_prefill_tokens < config.max_model_len:
            raise ValueError(
                f"with --chunked-prefill-size -1, --max-prefill-tokens ({config.max_prefill_tokens}) "
                f"must cover --max-model-len ({config.max_model_len})"
            )
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, events=kv_events
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._slots_to_free: list[int] = []  # released in the worker after the next step
        self._by_slot: dict[int, Request] = {}
        # Steps sent and not yet processed, oldest first: (request, epoch, tokens, sample, draft room) each.
        self._inflight: deque[list[tuple[Request, int, int, bool, int]]] = deque()
        self._eos = frozenset(config.eos_token_ids)
        self.step = 0
        self.num_preemptions = 0
        # Observability and the RL control plane (app/metrics, app/scheduler/rl_control.py).
        self.admission_open = True  # closed while a weight update drains the engine
        self.on_finish: FinishHook | None = None
        self.track_delays = False  # decode delays per request, for the request-stats line
        self.last_step_tokens = 0
        self.counters: StepCounters | None = None  # counted only once metrics take them (take_counters)
        self._step_times: deque[float] = deque()  # when each in-flight step was planned
        self._last_result_time = 0.0

    # ------------------------------------------------------------------ admission

    def add_request(self, msg: p.TokenizedRequest) -> None:
        """Queue a request; raises AdmissionError if it can never fit."""
        cfg = self.config
        if msg.rid in self.requests:
            raise AdmissionError(f"request id {msg.rid!r} is already in use")
        if cfg.max_queued_requests is not None and len(self.requests) >= cfg.max_num_seqs + cfg.max_queued_requests:
            raise QueueFull(
                f"the server is at capacity: {len(self.requests)} requests are running or queued "
                f"(--max-num-seqs {cfg.max_num_seqs} + --max-queued-requests {cfg.max_queued_requests}); retry later"
            )
        n_prompt = len(msg.prompt_ids)
        room = cfg.max_model_len - n_prompt
        if n_prompt == 0 or room <= 0:
            raise AdmissionError(
                f"prompt of {n_prompt} tokens leaves no room to generate within --max-model-len {cfg.max_model_len}"
            )
        requested = msg.sampling.max_new_tokens
        max_new = room if requested is None else min(requested, room)
        if self.kv.blocks_needed(n_prompt + max_new) > cfg.num_blocks:
            raise AdmissionError(
                f"request needs {n_prompt + max_new} tokens of KV cache (prompt {n_prompt} + max_tokens "
                f"{max_new}) but the pool holds {cfg.pool_tokens} (raise --max-total-tokens or "
                "--gpu-memory-utilization, or lower max_tokens)"
            )
        req = Request(msg.rid, list(msg.prompt_ids), msg.sampling, max_new, msg.arrival_time or time.time())
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._slots_to_free)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> p.StepPlan | None:
        """Plan the next step, or None when there is nothing to send to the worker."""
        plan = p.StepPlan(step=self.step)
        inflight: list[tuple[Request, int, int, bool, int]] = []
        budget = self.config.token_budget
        budget = self._schedule_running(plan, inflight, budget)
        self._schedule_waiting(plan, inflight, budget)
        plan.free_slots, self._slots_to_free = self._slots_to_free, []
        if not plan.chunks and not plan.free_slots:
            return None
        self._free_slots.extend(plan.free_slots)  # the worker releases them after this step
        self._inflight.append(inflight)
        self._step_times.append(time.time())
        self.last_step_tokens = sum(n + k for _, _, n, _, k in inflight)
        self.step += 1
        return plan

    def _schedule_running(self, plan: p.StepPlan, inflight: list, budget: int) -> int:
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._schedulable(req), budget)
            if n == 0:
                i += 1
                continue
            new_blocks = self._grow(req, req.num_fed + n, scheduled)
            if new_blocks is None:
                continue  # req itself was preempted: running[i] is now the next request
            k = self._lookahead(req, n, budget - n, new_blocks)
            self._add_chunk(plan, inflight, req, n, new_blocks, k)
            scheduled.add(id(req))
            budget -= n + k
            i += 1
        return budget

    def _draft_len(self, req: Request) -> int:
        """Draft tokens req's next decode may verify: 0 unless speculating on a decode the worker feeds
        itself, for a request whose sampling the verifier reproduces exactly; never past its length limits
        (the step adds up to k + 1 tokens). Rows that need per-token state (penalties, bias, min_tokens,
        grammars, logprobs, seeds) decode one token at a time (docs/speculative.md)."""
        k = self.config.num_speculative_tokens
        sp = req.sampling
        if (
            k == 0
            or req.num_to_feed != 1
            or req.num_pending_samples
            or not req.worker_has_last_token
            or len(req.output_ids) < sp.min_new_tokens
            or sp.grammar is not None
            or sp.logprobs
            or sp.top_logprobs
            or sp.seed is not None
            or sp.logit_bias
            or sp.presence_penalty
            or sp.frequency_penalty
            or sp.repetition_penalty != 1.0
            or sp.prompt_logprob_start >= 0
        ):
            return 0
        return max(0, min(k, req.max_new_tokens - len(req.output_ids) - 1,
                          self.config.max_model_len - req.num_tokens - 1))

    def _lookahead(self, req: Request, n: int, budget: int, new_blocks: list[int]) -> int:
        """Room for req's drafts in this step (budget tokens, free blocks: drafts never preempt anyone);
        their blocks are appended to new_blocks."""
        k = min(self._draft_len(req), budget) if n == 1 else 0
        while k > 0:
            need = self.kv.blocks_needed(req.num_fed + n + k) - len(req.block_ids)
            if need <= self.kv.num_free_blocks:
                extra = self.kv.allocate(need) if need > 0 else []
                req.block_ids.extend(extra)
                new_blocks.extend(extra)
                return k
            k -= 1
        return 0

    def _schedulable(self, req: Request) -> int:
        """Tokens req could feed now: none if a length limit ends it when in-flight work lands."""
        if req.num_pending_samples and (
            req.num_promised >= req.max_new_tokens or req.num_known >= self.config.max_model_len
        ):
            return 0
        return req.num_to_feed

    def _grow(self, req: Request, num_tokens: int, scheduled: set[int]) -> list[int] | None:
        """Blocks for req to hold num_tokens, preempting the latest-admitted requests not yet
        in this step if needed. None if req itself had to be preempted."""
        need = self.kv.blocks_needed(num_tokens) - len(req.block_ids)
        while need > self.kv.num_free_blocks:
            victim = self.running[-1]
            assert id(victim) not in scheduled
            self._preempt(victim)
            if victim is req:
                return None
        new_blocks = self.kv.allocate(need) if need > 0 else []
        req.block_ids.extend(new_blocks)
        return new_blocks

    def _schedule_waiting(self, plan: p.StepPlan, inflight: list, budget: int) -> None:
        cfg = self.config
        if not self.admission_open:
            return
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and self._free_slots:
            req = self.waiting[0]
            tokens = req.token_slice(0, req.num_tokens)
            cached = self.kv.match_prefix(tokens)
            wanted = req.prompt_logprob_next()
            if wanted >= 0:  # a cached prefix has no hidden states: recompute from the first wanted position
                cached = cached[: max(wanted - 1, 0) // cfg.block_size]
            n_cached = len(cached) * cfg.block_size
            n = min(req.num_tokens - n_cached, budget)
            if not cfg.chunking and n < req.num_tokens - n_cached:
                break  # without chunking a prompt is prefilled whole: wait for a fresh budget
            self.kv.acquire(cached)
            need = self.kv.blocks_needed(n_cached + n) - len(cached)
            if need > self.kv.num_free_blocks:
                self.kv.release(cached)
                break
            self.waiting.popleft()
            req.block_ids = cached + self.kv.allocate(need)
            req.num_computed = n_cached
            req.block_hashes = [self.kv.blocks[b].hash for b in cached]
            if req.num_preemptions == 0:
                req.cached_tokens = n_cached
            req.status = Status.RUNNING
            req.slot = self._free_slots.pop()
            req.worker_has_last_token = False
            req.cacheable = True  # recomputed from scratch with the current weights
            self._count_admission(req, n_cached)
            self._by_slot[req.slot] = req
            self.running.append(req)
            n_prompt = len(req.prompt_ids)
            plan.new_seqs.append(
                p.NewSeq(
                    slot=req.slot,
                    rid=req.rid,
                    sampling=_with_prompt_start(req.sampling, wanted),
                    num_prompt_tokens=n_prompt,
                    block_ids=list(req.block_ids),
                    num_cached_tokens=n_cached,
                    output_ids=list(req.output_ids),
                    prompt_ids=req.prompt_ids,
                )
            )
            self._add_chunk(plan, inflight, req, n, [])
            budget -= n

    def _count_admission(self, req: Request, n_cached: int) -> None:
        first = req.first_scheduled_time is None
        if first:
            req.first_scheduled_time = time.time()
        c = self.counters
        if c is None:
            return
        c.prefix_query_tokens += req.num_tokens
        c.prefix_hit_tokens += n_cached
        if first:
            c.queue_times.append(max(req.first_scheduled_time - req.arrival_time, 0.0))

    def take_counters(self) -> StepCounters:
        """What was counted since the last call (the metrics take it once per loop iteration); the first
        call starts the counting."""
        counters, self.counters = self.counters or StepCounters(), StepCounters()
        return counters

    def _add_chunk(
        self, plan: p.StepPlan, inflight: list, req: Request, n: int, new_blocks: list[int], k: int = 0
    ) -> None:
        fed = req.num_fed
        sample = fed + n == req.num_known
        # The worker feeds its own last sample: always for one still in flight, and as an
        # optimisation for the last output token it sampled in this slot.
        decode = n == 1 and sample and (req.num_pending_samples > 0 or req.worker_has_last_token)
        tokens = [] if decode else req.token_slice(fed, fed + n)
        plan.chunks.append(p.SeqChunk(req.slot, tokens, new_blocks, sample, k))
        inflight.append((req, req.epoch, n, sample, k))
        req.num_inflight_tokens += n
        req.num_pending_samples += sample

    def _preempt(self, req: Request) -> None:
        """Release req's KV and slot; it resumes later by recomputing prompt + output."""
        log.info("preempting request %s (%d tokens) to free KV blocks", req.rid, req.num_tokens)
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.kv.release(req.block_ids)
        req.block_ids, req.block_hashes, req.num_computed = [], [], 0
        req.num_inflight_tokens = req.num_pending_samples = 0
        req.epoch += 1  # whatever is still in flight for it is void
        if req.slot is not None:
            self._by_slot.pop(req.slot, None)
            self._slots_to_free.append(req.slot)
            req.slot = None

    # ------------------------------------------------------------------ results

    def process_result(self, result: p.StepResult) -> list[p.TokenDelta]:
        """Apply the oldest in-flight step's result; returns the deltas to stream out."""
        inflight = self._inflight.popleft() if self._inflight else []
        planned = self._step_times.popleft() if self._step_times else 0.0
        live = [(req, n, sample) for req, epoch, n, sample, _ in inflight if req.epoch == epoch]
        drafting = {req.slot for req, epoch, _, _, k in inflight if k and req.epoch == epoch}
        now = time.time()
        if self.track_delays:
            self._note_delays(live, result.step, now - max(planned, self._last_result_time))
        self._last_result_time = now
        deltas: list[p.TokenDelta] = []
        if result.error is not None:
            for req, _, _ in live:
                if req.status is Status.RUNNING:
                    deltas.append(self._fail(req, f"engine step failed: {result.error}", 500))
            return deltas
        refused = dict(zip(result.failed_slots, result.failed_errors, strict=True))
        if refused:  # the worker refused these sequences alone: each fails; the step's others go on
            gone = [req for req, _, _ in live if req.slot in refused and req.status is Status.RUNNING]
            deltas += [self._fail(req, refused[req.slot], 400) for req in gone]
            live = [entry for entry in live if entry[0] not in gone]
        for req, n, sample in live:
            req.num_computed += n
            req.num_inflight_tokens -= n
            req.num_pending_samples -= sample
            if req.prefill_done_time is None and req.num_computed >= len(req.prompt_ids):
                req.prefill_done_time = now
            self._register_full_blocks(req)
        bad = set(result.bad_slots)
        for slot, lps in zip(result.prompt_slots, result.prompt_logprobs, strict=True):
            owner = next((req for req, _, _ in live if req.slot == slot), None)
            if owner is not None and owner.status is Status.RUNNING:
                owner.prompt_logprobs += lps
        expected = {req.slot: req for req, _, sample in live if sample}
        logprobs = result.logprobs or [None] * len(result.slots)
        accepted = result.accepted_ids or [[]] * len(result.slots)
        drafted = result.draft_counts or [0] * len(result.slots)
        for slot, token, lp, extra, n_draft in zip(result.slots, result.token_ids, logprobs, accepted, drafted,
                                                   strict=True):
            req = expected.get(slot)
            if req is None or req.status is not Status.RUNNING:
                continue  # finished, aborted or preempted since the step was planned
            if slot in bad:
                deltas.append(self._fail(req, "the model produced NaN or inf logits", 500))
                continue
            if slot in drafting:
                self._count_drafts(req, n_draft, len(extra))
            deltas.append(self._append_tokens(req, [*extra, token], lp, now))
            if slot in drafting and req.status is Status.RUNNING:
                self._trim_blocks(req)
        return deltas

    def _count_drafts(self, req: Request, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        req.spec_verify_steps += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_tokens += accepted
        c = self.counters
        if c is not None:
            c.spec_drafts += 1
            c.spec_draft_tokens += drafted
            c.spec_accepted_tokens += accepted
            per = c.spec_accepted_per_position
            per.extend([0] * (accepted - len(per)))
            for i in range(accepted):
                per[i] += 1

    def _trim_blocks(self, req: Request) -> None:
        """After a step that could verify drafts: free the blocks past what the kept tokens need (the
        rejected drafts' positions), as the worker does for the slot (protocol.SeqChunk.num_draft)."""
        keep = self.kv.blocks_needed(req.num_tokens)
        if len(req.block_ids) > keep:
            self.kv.release(req.block_ids[keep:])
            del req.block_ids[keep:]

    @staticmethod
    def _note_delays(live: list[tuple[Request, int, bool]], step: int, elapsed: float) -> None:
        """A step that prefills delays the requests decoding in it: their decode lost its duration."""
        decoding = [req for req, n, _ in live if n == 1 and req.first_token_time is not None]
        if len(decoding) == len(live):
            return
        for req in decoding:
            if req.last_delayed_step != step - 1:
                req.delay_count += 1  # a new stretch of delayed steps
            req.last_delayed_step = step
            req.delayed_seconds += max(elapsed, 0.0)

    def _append_tokens(
        self, req: Request, tokens: list[int], lp: p.TokenLogprobs | None, now: float
    ) -> p.TokenDelta:
        """Append a step's tokens (accepted drafts, then the sampled one), up to the first that ends req
        (the rest are dropped). All but the last were fed in the step: their KV is computed."""
        req.worker_has_last_token = True
        req.first_token_time = req.first_token_time or now
        reason = matched = None
        for i, token in enumerate(tokens):
            req.output_ids.append(token)
            if i < len(tokens) - 1:
                req.num_computed += 1
            reason, matched = self._stop_reason(req, token)
            if reason is not None:
                tokens = tokens[: i + 1]
                break
        if len(tokens) > 1:
            self._register_full_blocks(req)
        delta = self._delta(req, tokens, [lp] if lp is not None else [])
        if req.sampling.prompt_logprob_start >= 0 and not req.prompt_logprobs_sent:
            delta.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        if reason is not None:
            delta.finish_reason, delta.matched_stop = reason, matched
            self._finish(req, now, reason)
        return delta

    def _stop_reason(self, req: Request, token: int) -> tuple[str | None, int | None]:
        sp = req.sampling
        n_out = len(req.output_ids)
        if n_out >= sp.min_new_tokens:
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in self._eos):
                return p.FINISH_STOP, token
        if n_out >= req.max_new_tokens or req.num_tokens >= self.config.max_model_len:
            return p.FINISH_LENGTH, None
        return None, None

    def _register_full_blocks(self, req: Request) -> None:
        bs = self.config.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_computed:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = req.token_slice(i * bs, (i + 1) * bs)
            if req.cacheable:
                parent_block = req.block_ids[i - 1] if i else None
                req.block_hashes.append(self.kv.register(req.block_ids[i], parent, tokens, parent_block))
            else:  # its KV mixes weight versions: keep it out of the prefix cache
                req.block_hashes.append(chain_hash(parent, tokens)[1])

    def _delta(self, req: Request, tokens: list[int], logprobs: list) -> p.TokenDelta:
        return p.TokenDelta(
            rid=req.rid,
            token_ids=tokens,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            logprobs=logprobs,
        )

    # ------------------------------------------------------------------ endings

    def _finish(self, req: Request, now: float | None = None, reason: str = p.FINISH_ABORT) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_time = now or time.time()
        self.requests.pop(req.rid, None)
        if self.on_finish is not None:
            self.on_finish(req, reason)

    def _fail(self, req: Request, message: str, code: int) -> p.TokenDelta:
        delta = self._delta(req, [], [])
        delta.finish_reason, delta.error, delta.error_code = p.FINISH_ABORT, message, code
        self._finish(req)
        return delta

    def abort(self, rid: str, reason: str = "aborted") -> p.TokenDelta | None:
        """Abort a request wherever it is; returns its terminal delta (None if unknown)."""
        req = self.requests.get(rid)
        if req is None:
            return None
        delta = self._delta(req, [], [])
        delta.finish_reason, delta.error = p.FINISH_ABORT, reason
        self._finish(req)
        return delta

    def expire(self, now: float) -> list[p.TokenDelta]:
        """Fail (504) every request past --request-timeout since its arrival, or past --ttft-timeout
        without a first token; their KV blocks are freed at once."""
        cfg = self.config
        if cfg.request_timeout is None and cfg.ttft_timeout is None:
            return []
        deltas = []
        for req in list(self.requests.values()):
            age = now - req.arrival_time
            if cfg.request_timeout is not None and age > cfg.request_timeout:
                message = f"the request timed out after {age:.1f} s (--request-timeout {cfg.request_timeout:g})"
            elif cfg.ttft_timeout is not None and req.first_token_time is None and age > cfg.ttft_timeout:
                message = f"no first token after {age:.1f} s (--ttft-timeout {cfg.ttft_timeout:g}): the server is overloaded"
            else:
                continue
            deltas.append(self._fail(req, message, 504))
        return deltas

    def abort_all(self, reason: str = "aborted") -> list[p.TokenDelta]:
        return [d for rid in list(self.requests) if (d := self.abort(rid, reason)) is not None]

    def finish(self, rid: str) -> None:
        """The tokenizer finished rid (stop string): free it without another delta."""
        req = self.requests.get(rid)
        if req is not None:
            self._finish(req, reason=p.FINISH_STOP)

    def flush_cache(self) -> int:
        return self.kv.flush()

    def retract_all(self) -> int:
        """Move every running request back to the queue, its KV freed (it is recomputed later, its
        output unchanged; work still in flight for it is void); returns how many."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        return count

    def mark_running_stale(self) -> None:
        """The weights changed under the running requests: their KV mixes versions, so nothing more
        of theirs enters the prefix cache (until a preemption recomputes them)."""
        for req in self.running:
            req.cacheable = False

    def loads(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.kv.usage,
            "num_used_blocks": self.kv.num_used_blocks,
            "num_cached_blocks": self.kv.num_cached_blocks,
            "num_blocks": self.config.num_blocks,
            "num_preemptions": self.num_preemptions,
        }


def _with_prompt_start(sampling: p.SamplingParams, wanted: int) -> p.SamplingParams:
    """The sampling the worker gets: prompt logprobs from `wanted` on (none once all are in)."""
    if sampling.prompt_logprob_start == wanted:
        return sampling
    return dataclasses.replace(sampling, prompt_logprob_start=wanted)
