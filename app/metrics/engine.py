"""The scheduler's metrics: gauges and counters updated once per step (never per token)."""

from __future__ import annotations

from typing import Any

from app.metrics.catalog import build

_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
          "prefix_cache_hits", "num_preemptions", "iteration_tokens_total", "request_queue_time_seconds")
_SPEC_NAMES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
               "spec_decode_num_accepted_tokens_per_pos")


class EngineMetrics:
    """Reads the scheduler's state and counters: planned() per step sent, update() per loop iteration."""

    def __init__(self, sched: Any, model_name: str, dp_rank: int = 0, registry: Any = None) -> None:
        self.sched = sched
        sched.take_counters()  # the scheduler counts from now on
        m = build(_NAMES, registry)
        labels = {"model_name": model_name, "dp_rank": str(dp_rank)}
        self._running = m["num_requests_running"].labels(**labels)
        self._waiting = m["num_requests_waiting"].labels(**labels)
        self._usage = m["kv_cache_usage_perc"].labels(**labels)
        self._queries = m["prefix_cache_queries"].labels(**labels)
        self._hits = m["prefix_cache_hits"].labels(**labels)
        self._preemptions = m["num_preemptions"].labels(**labels)
        self._step_tokens = m["iteration_tokens_total"].labels(**labels)
        self._queue_time = m["request_queue_time_seconds"].labels(**labels)
        self._seen_preemptions = 0
        # Speculative decoding's counters exist only when it is on (a series that is always 0 misleads).
        self._spec = build(_SPEC_NAMES, registry) if sched.config.num_speculative_tokens else None
        self._labels = labels

    def planned(self, step_tokens: int) -> None:
        """A step went to the worker with this many tokens (steps that only free slots do not count)."""
        if step_tokens:
            self._step_tokens.observe(step_tokens)

    def update(self) -> None:
        """Once per loop iteration: gauges from the scheduler's state, counters from what it counted
        since the last call."""
        sched = self.sched
        self._running.set(len(sched.running))
        self._waiting.set(len(sched.waiting))
        self._usage.set(sched.kv.usage)
        counters = sched.take_counters()
        if counters.prefix_query_tokens:
            self._queries.inc(counters.prefix_query_tokens)
        if counters.prefix_hit_tokens:
            self._hits.inc(counters.prefix_hit_tokens)
        for seconds in counters.queue_times:
            self._queue_time.observe(seconds)
        if self._spec is not None:
            self._count_spec(counters)
        if sched.num_preemptions > self._seen_preemptions:
            self._preemptions.inc(sched.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = sched.num_preemptions

    def _count_spec(self, counters: Any) -> None:
        m, labels = self._spec, self._labels
        assert m is not None
        if counters.spec_drafts:
            m["spec_decode_num_drafts"].labels(**labels).inc(counters.spec_drafts)
            m["spec_decode_num_draft_tokens"].labels(**labels).inc(counters.spec_draft_tokens)
        if counters.spec_accepted_tokens:
            m["spec_decode_num_accepted_tokens"].labels(**labels).inc(counters.spec_accepted_tokens)
        for position, count in enumerate(counters.spec_accepted_per_position):
            m["spec_decode_num_accepted_tokens_per_pos"].labels(**labels, position=str(position)).inc(count)
