"""Every Prometheus metric the appliance exports: name, type, labels, buckets, help, in one table.

Names follow TokenSpeed (`tokenspeed:` prefix). prometheus_client appends `_total` to counters when
it exposes them (tokenspeed:prompt_tokens is scraped as tokenspeed:prompt_tokens_total). Metrics are
created per process from this table (app/metrics/engine.py in the scheduler, frontend.py in the
tokenizer, startup in http) and merged at scrape time by prometheus_client's multiprocess mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREFIX = "tokenspeed:"
ENGINE = ("model_name", "dp_rank")  # recorded by a scheduler (one per data-parallel rank)
FRONTEND = ("model_name",)  # recorded once per request, in the tokenizer process

# Buckets, in seconds unless noted.
LATENCY_FAST = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0)
REQUEST = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0)
QUEUE = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
         300.0, 600.0)
STEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the prefix
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()
    # Gauges only: how prometheus_client merges the processes' values in multiprocess mode.
    multiprocess_mode: str = "livemostrecent"

    @property
    def full_name(self) -> str:
        return PREFIX + self.name


SPECS: tuple[MetricSpec, ...] = (
    # ---- scheduler, once per step
    MetricSpec("num_requests_running", "gauge", ENGINE, "Requests in the running batch."),
    MetricSpec("num_requests_waiting", "gauge", ENGINE, "Requests queued for admission."),
    MetricSpec("kv_cache_usage_perc", "gauge", ENGINE,
               "Fraction (0-1) of KV cache blocks held by live requests."),
    MetricSpec("prefix_cache_queries", "counter", ENGINE, "Tokens looked up in the prefix cache at admission."),
    MetricSpec("prefix_cache_hits", "counter", ENGINE, "Tokens served from the prefix cache at admission."),
    MetricSpec("num_preemptions", "counter", ENGINE,
               "Requests preempted (KV released, recomputed later) to free KV blocks."),
    MetricSpec("iteration_tokens_total", "histogram", ENGINE, "Tokens fed to the model per step.",
               STEP_TOKENS),
    MetricSpec("request_queue_time_seconds", "histogram", ENGINE,
               "Time from arrival to first scheduling, per request.", QUEUE),
    # ---- scheduler, speculative decoding (vLLM's names)
    MetricSpec("spec_decode_num_drafts", "counter", ENGINE, "Verify steps of a sequence that drafted tokens."),
    MetricSpec("spec_decode_num_draft_tokens", "counter", ENGINE, "Draft tokens verified."),
    MetricSpec("spec_decode_num_accepted_tokens", "counter", ENGINE, "Draft tokens accepted."),
    MetricSpec("spec_decode_num_accepted_tokens_per_pos", "counter", (*ENGINE, "position"),
               "Draft tokens accepted at each draft position (0: the first draft)."),
    # ---- tokenizer, per request
    MetricSpec("num_requests", "counter", FRONTEND, "Requests finished, whatever the reason."),
    MetricSpec("request_success", "counter", (*FRONTEND, "finished_reason"),
               "Requests finished normally (stop or length), by finish reason."),
    MetricSpec("prompt_tokens", "counter", FRONTEND, "Prompt tokens of finished requests."),
    MetricSpec("generation_tokens", "counter", FRONTEND, "Tokens generated."),
    MetricSpec("time_to_first_token_seconds", "histogram", FRONTEND,
               "Time from arrival to the first output token.", TTFT),
    MetricSpec("inter_token_latency_seconds", "histogram", FRONTEND,
               "Time between consecutive output tokens of a request.", LATENCY_FAST),
    MetricSpec("request_time_per_output_token_seconds", "histogram", FRONTEND,
               "Per request: (finish - first token) / (output tokens - 1).", LATENCY_FAST),
    MetricSpec("e2e_request_latency_seconds", "histogram", FRONTEND,
               "Time from arrival to finish of requests that finished normally.", REQUEST),
    # ---- http, once at start-up
    MetricSpec("startup_time_seconds", "gauge", (*FRONTEND, "phase"),
               "Start-up time by phase: weights, kv_pool, graphs, warmup, total.",
               multiprocess_mode="mostrecent"),
)
BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in SPECS}


def _histogram_class() -> type:
    from prometheus_client import Histogram

    class BatchHistogram(Histogram):
        """A Histogram that can record one value observed `count` times in two writes, not 2 x count
        (a step's decodes share one inter-token gap). Uses the parent's value slots (prometheus-client
        0.26 is pinned; a unit test checks it equals `count` plain observations)."""

        def observe_many(self, amount: float, count: int) -> None:
            self._raise_if_not_observable()
            if count <= 0:
                return
            self._sum.inc(amount * count)
            for i, bound in enumerate(self._upper_bounds):
                if amount <= bound:
                    self._buckets[i].inc(count)
                    break

    return BatchHistogram


def build(names: tuple[str, ...], registry: Any = None) -> dict[str, Any]:
    """prometheus_client metric objects for these specs. registry None: not registered anywhere,
    which is what multiprocess mode wants (the scrape reads every process's files instead)."""
    from prometheus_client import Counter, Gauge

    histogram = _histogram_class()
    out: dict[str, Any] = {}
    for name in names:
        spec = BY_NAME[name]
        common = {"name": spec.full_name, "documentation": spec.help, "labelnames": spec.labels,
                  "registry": registry}
        if spec.kind == "counter":
            out[name] = Counter(**common)
        elif spec.kind == "gauge":
            out[name] = Gauge(**common, multiprocess_mode=spec.multiprocess_mode)
        else:
            out[name] = histogram(**common, buckets=spec.buckets)
    return out
