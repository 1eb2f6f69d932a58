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
No torch here: the scheduler reasons about token ids and block ids only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from app import protocol as p
from app.scheduler.kv_cache import KVCacheManager
from app.scheduler.request import Request, Status

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


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if not config.chunking and config.max_prefill_tokens < config.max_model_len:
            raise ValueError(
                f"with --chunked-prefill-size -1, --max-prefill-tokens ({config.max_prefill_tokens}) "
                f"must cover --max-model-len ({config.max_model_len})"
            )
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._slots_to_free: list[int] = []  # released in the worker after the next step
        self._by_slot: dict[int, Request] = {}
        self._inflight: list[tuple[Request, int, bool]] | None = None  # (request, tokens, sample)
        self._eos = frozenset(config.eos_token_ids)
        self.step = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission

    def add_request(self, msg: p.TokenizedRequest) -> None:
        """Queue a request; raises AdmissionError if it can never fit."""
        cfg = self.config
        if msg.rid in self.requests:
            raise AdmissionError(f"request id {msg.rid!r} is already in use")
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

    # ------------------------------------------------------------------ planning

    def schedule(self) -> p.StepPlan | None:
        """Plan the next step, or None when there is nothing to send to the worker."""
        assert self._inflight is None, "schedule() called with a step in flight"
        plan = p.StepPlan(step=self.step)
        inflight: list[tuple[Request, int, bool]] = []
        budget = self.config.token_budget
        budget = self._schedule_running(plan, inflight, budget)
        self._schedule_waiting(plan, inflight, budget)
        plan.free_slots, self._slots_to_free = self._slots_to_free, []
        if not plan.chunks and not plan.free_slots:
            return None
        self._free_slots.extend(plan.free_slots)  # the worker releases them after this step
        self._inflight = inflight
        self.step += 1
        return plan

    def _schedule_running(self, plan: p.StepPlan, inflight: list, budget: int) -> int:
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending, budget)
            new_blocks = self._grow(req, req.num_computed + n, scheduled)
            if new_blocks is None:
                continue  # req itself was preempted: running[i] is now the next request
            self._add_chunk(plan, inflight, req, n, new_blocks)
            scheduled.add(id(req))
            budget -= n
            i += 1
        return budget

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
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and self._free_slots:
            req = self.waiting[0]
            tokens = req.token_slice(0, req.num_tokens)
            cached = self.kv.match_prefix(tokens)
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
            req.first_scheduled_time = req.first_scheduled_time or time.time()
            self._by_slot[req.slot] = req
            self.running.append(req)
            n_prompt = len(req.prompt_ids)
            plan.new_seqs.append(
                p.NewSeq(
                    slot=req.slot,
                    rid=req.rid,
                    sampling=req.sampling,
                    num_prompt_tokens=n_prompt,
                    block_ids=list(req.block_ids),
                    num_cached_tokens=n_cached,
                    output_ids=list(req.output_ids),
                    prompt_ids=req.prompt_ids,
                )
            )
            self._add_chunk(plan, inflight, req, n, [])
            budget -= n

    def _add_chunk(self, plan: p.StepPlan, inflight: list, req: Request, n: int, new_blocks: list[int]) -> None:
        sample = req.num_computed + n == req.num_tokens
        decode = n == 1 and sample and req.worker_has_last_token
        tokens = [] if decode else req.token_slice(req.num_computed, req.num_computed + n)
        plan.chunks.append(p.SeqChunk(req.slot, tokens, new_blocks, sample))
        inflight.append((req, n, sample))

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
        if req.slot is not None:
            self._by_slot.pop(req.slot, None)
            self._slots_to_free.append(req.slot)
            req.slot = None

    # ------------------------------------------------------------------ results

    def process_result(self, result: p.StepResult) -> list[p.TokenDelta]:
        """Apply a step's sampled tokens; returns the deltas to stream out."""
        inflight, self._inflight = self._inflight or [], None
        now = time.time()
        deltas: list[p.TokenDelta] = []
        if result.error is not None:
            for req, _, _ in inflight:
                if req.status is Status.RUNNING:
                    deltas.append(self._fail(req, f"engine step failed: {result.error}", 500))
            return deltas
        for req, n, _ in inflight:
            if req.status is Status.RUNNING:  # not finished or aborted while in flight
                req.num_computed += n
                self._register_full_blocks(req)
        bad = set(result.bad_slots)
        logprobs = result.logprobs or [None] * len(result.slots)
        for slot, token, lp in zip(result.slots, result.token_ids, logprobs, strict=True):
            req = self._by_slot.get(slot)
            if req is None or req.status is not Status.RUNNING:
                continue
            if slot in bad:
                deltas.append(self._fail(req, "the model produced NaN or inf logits", 500))
                continue
            deltas.append(self._append_token(req, token, lp, now))
        return deltas

    def _append_token(self, req: Request, token: int, lp: p.TokenLogprobs | None, now: float) -> p.TokenDelta:
        req.output_ids.append(token)
        req.worker_has_last_token = True
        req.first_token_time = req.first_token_time or now
        reason, matched = self._stop_reason(req, token)
        delta = self._delta(req, [token], [lp] if lp is not None else [])
        if reason is not None:
            delta.finish_reason, delta.matched_stop = reason, matched
            self._finish(req, now)
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
            req.block_hashes.append(self.kv.register(req.block_ids[i], parent, tokens))

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

    def _finish(self, req: Request, now: float | None = None) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_time = now or time.time()
        self.requests.pop(req.rid, None)

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

    def abort_all(self, reason: str = "aborted") -> list[p.TokenDelta]:
        return [d for rid in list(self.requests) if (d := self.abort(rid, reason)) is not None]

    def finish(self, rid: str) -> None:
        """The tokenizer finished rid (stop string): free it without another delta."""
        req = self.requests.get(rid)
        if req is not None:
            self._finish(req)

    def flush_cache(self) -> int:
        return self.kv.flush()

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
