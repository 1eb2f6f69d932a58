"""--enable-log-request-stats: the RequestStats fields, the scheduler's finish hook and decode delays."""

from __future__ import annotations

import logging
import re
import time

from app import protocol as p
from app.metrics.request_stats import FinishLogger, RequestStats, request_stats
from app.scheduler.request import Request
from app.scheduler.scheduler import Scheduler, SchedulerConfig

T0 = 1_782_255_696.726


def finished_request() -> Request:
    req = Request("r1", list(range(20)), p.SamplingParams(max_new_tokens=5), 5, arrival_time=T0)
    req.output_ids = [1, 2, 3, 4, 5]
    req.cached_tokens = 8
    req.first_scheduled_time = T0 + 0.0138
    req.prefill_done_time = T0 + 0.0296
    req.first_token_time = T0 + 0.0421
    req.finish_time = T0 + 0.0580
    req.delayed_seconds, req.delay_count = 0.0031, 2
    return req


def test_fields_follow_the_seed_definitions() -> None:
    stats = request_stats(finished_request(), "stop")
    assert stats == RequestStats(
        status="finished", reason="stop", prompt_tokens=20, cache_tokens=8, output_tokens=5, cache_hit_rate=0.4,
        queue_ms=13.8, prefill_ms=15.8, ttft_ms=42.1, total_ms=58.0, preempt_ms=3.1, preempt_count=2,
        decode_tps=round(4 / 0.0159, 1), acc_len=None, acc_rate=None, recv_ts=round(T0, 3),
        commit_ts=round(T0 + 0.0138, 3), finish_ts=round(T0 + 0.058, 3),
    )
    assert repr(stats).startswith("RequestStats(status='finished', reason='stop', prompt_tokens=20, cache_tokens=8")


def test_speculative_acceptance_fields() -> None:
    req = finished_request()
    req.spec_verify_steps, req.spec_draft_tokens, req.spec_accepted_tokens = 2, 6, 2
    stats = request_stats(req, "stop", speculative=True)
    assert (stats.acc_len, stats.acc_rate) == (2.0, round(2 / 6, 4))  # 4 tokens in 2 verify steps
    idle = request_stats(finished_request(), "stop", speculative=True)  # never drafted (e.g. penalties)
    assert (idle.acc_len, idle.acc_rate) == (1.0, 0.0)


def test_an_abort_in_the_queue_has_no_schedule_or_token_times() -> None:
    req = Request("r2", [1, 2, 3], p.SamplingParams(), 10, arrival_time=T0)
    req.finish_time = T0 + 0.5
    stats = request_stats(req, p.FINISH_ABORT)
    assert (stats.status, stats.reason, stats.queue_ms, stats.prefill_ms, stats.ttft_ms, stats.commit_ts) == (
        "aborted", "abort", None, None, None, None)
    assert stats.total_ms == 500.0 and stats.decode_tps == 0.0 and stats.output_tokens == 0


def test_finish_logger_lines(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="tokenspeed.scheduler")
    FinishLogger(True)(finished_request(), "length")
    FinishLogger(False)(finished_request(), "length")
    lines = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"Req: r1 Finish! RequestStats\(status='finished', reason='length', .*\)", lines[0])
    assert lines[1] == "Req: r1 Finish! reason=length, output_tokens=5"
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]


# ---------------------------------------------------------------- the scheduler's side


def make(chunk: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256, max_num_seqs=4,
                                     chunked_prefill_size=chunk, max_prefill_tokens=256,
                                     enable_prefix_caching=True, eos_token_ids=(0,)))


def sample_all(plan: p.StepPlan, token: int = 7) -> p.StepResult:
    slots = [c.slot for c in plan.chunks if c.sample]
    return p.StepResult(step=plan.step, slots=slots, token_ids=[token] * len(slots))


def drive(sched: Scheduler, steps: int = 50, arrivals: dict[int, p.TokenizedRequest] | None = None,
          prefill_seconds: float = 0.0) -> int:
    """Run to completion; a step that feeds a prefill chunk takes prefill_seconds. Returns those steps."""
    prefills = 0
    for i in range(steps):
        if arrivals and i in arrivals:
            sched.add_request(arrivals.pop(i))
        plan = sched.schedule()
        if plan is None:
            if not arrivals:
                return prefills
            continue
        if any(len(c.token_ids) > 1 for c in plan.chunks):
            prefills += 1
            time.sleep(prefill_seconds)
        sched.process_result(sample_all(plan))
    return prefills


def req(rid: str, prompt: list[int], max_new: int, **kw) -> p.TokenizedRequest:
    return p.TokenizedRequest(rid, prompt, p.SamplingParams(max_new_tokens=max_new, temperature=0, **kw))


def test_the_finish_hook_sees_every_ending_with_its_reason() -> None:
    sched = make()
    ended: list[tuple[str, str, float | None]] = []
    sched.on_finish = lambda r, reason: ended.append((r.rid, reason, r.prefill_done_time))
    sched.add_request(req("len", [1, 2, 3], 2))
    sched.add_request(req("stop", [4, 5, 6], 9, stop_token_ids=[7]))
    sched.add_request(req("gone", [1, 1], 9))
    sched.add_request(req("string", [2, 2], 9))
    plan = sched.schedule()
    sched.abort("gone")
    sched.process_result(sample_all(plan))
    sched.finish("string")  # the tokenizer matched a stop string
    drive(sched)
    assert sorted((rid, reason) for rid, reason, _ in ended) == [
        ("gone", "abort"), ("len", "length"), ("stop", "stop"), ("string", "stop")]
    assert all(done is not None for rid, _, done in ended if rid in ("len", "stop"))


def test_prefills_of_others_delay_a_decode_and_are_counted_per_stretch() -> None:
    sched = make(chunk=8)
    sched.track_delays = True
    stats: dict[str, Request] = {}
    sched.on_finish = lambda r, reason: stats.setdefault(r.rid, r)
    # "a" decodes while "b"'s 40-token prompt is prefilled in chunks of up to 7 tokens (budget 8 - 1).
    prefills = drive(sched, arrivals={0: req("a", [1, 2, 3], 30), 3: req("b", list(range(1, 41)), 2)},
                     prefill_seconds=0.005)
    a, b = stats["a"], stats["b"]
    assert prefills == 7  # a's own prompt, then b's 40 tokens in 6 chunks
    assert a.delay_count == 1 and a.last_delayed_step >= 3
    assert 6 * 0.005 <= a.delayed_seconds < 6 * 0.005 + 0.5
    assert b.delay_count == 0  # its own prefill is no delay to it
    assert a.prefill_done_time is not None and a.first_token_time is not None
