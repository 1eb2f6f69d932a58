"""Scheduler policy against a fake worker that really stores tokens in paged 'KV' blocks.

The fake model's next token is a hash of the whole context read back through the block table,
so any mistake in block tables, prefix sharing, chunking or preemption changes the output.
"""

from __future__ import annotations

import random

import pytest

from app import protocol as p
from app.scheduler.scheduler import AdmissionError, Scheduler, SchedulerConfig

VOCAB = 97
EOS = 0


def next_token(context: list[int]) -> int:
    h = 7
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (VOCAB - 1)  # never EOS: lengths are decided by max_tokens


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.slots: dict[int, dict] = {}

    def execute(self, plan: p.StepPlan) -> p.StepResult:
        result = p.StepResult(step=plan.step)
        for ns in plan.new_seqs:
            assert ns.slot not in self.slots, "slot reused before it was freed"
            self.slots[ns.slot] = {"blocks": list(ns.block_ids), "len": ns.num_cached_tokens, "last": None}
        for ch in plan.chunks:
            seq = self.slots[ch.slot]
            seq["blocks"] += ch.append_block_ids
            for t in ch.token_ids or [seq["last"]]:
                assert t is not None
                pos = seq["len"]
                self.kv[seq["blocks"][pos // self.bs] * self.bs + pos % self.bs] = t
                seq["len"] += 1
            if ch.sample:
                ctx = [self.kv[seq["blocks"][i // self.bs] * self.bs + i % self.bs] for i in range(seq["len"])]
                seq["last"] = next_token(ctx)
                result.slots.append(ch.slot)
                result.token_ids.append(seq["last"])
        for slot in plan.free_slots:
            del self.slots[slot]
        return result


def reference(prompt: list[int], max_new: int) -> list[int]:
    ctx = list(prompt)
    out = []
    for _ in range(max_new):
        out.append(next_token(ctx))
        ctx.append(out[-1])
    return out


def make(num_blocks=64, block_size=4, max_num_seqs=8, chunk=32, max_prefill=8192, max_len=256, prefix=True):
    cfg = SchedulerConfig(num_blocks, block_size, max_len, max_num_seqs, chunk, max_prefill, prefix, (EOS,))
    return Scheduler(cfg), FakeWorker(num_blocks, block_size)


def request(rid: str, prompt: list[int], max_new: int, **kw) -> p.TokenizedRequest:
    return p.TokenizedRequest(rid, prompt, p.SamplingParams(max_new_tokens=max_new, temperature=0, **kw))


def run(sched, worker, arrivals=None, max_steps=5000, check=None, overlap=False):
    """Drive to completion; arrivals maps step -> requests added before that step. With overlap,
    the scheduler plans step N+1 before it processes step N's result, as the process loop does."""
    outputs: dict[str, list[int]] = {}
    finals: dict[str, p.TokenDelta] = {}
    arrivals = arrivals or {}
    pending: list[p.StepResult] = []  # results the scheduler has not seen yet
    depth = 2 if overlap else 1
    for step in range(max_steps):
        for req in arrivals.pop(step, []):
            sched.add_request(req)
        plan = sched.schedule() if len(pending) < depth else None
        if plan is not None:
            if check:
                check(plan, sched)
            pending.append(worker.execute(plan))  # the worker runs steps in the order sent
        if pending and (plan is None or len(pending) == depth):
            for d in sched.process_result(pending.pop(0)):
                outputs.setdefault(d.rid, []).extend(d.token_ids)
                if d.finish_reason:
                    finals[d.rid] = d
        elif plan is None and not arrivals and not sched.has_work():
            break
    else:
        raise AssertionError("did not finish")
    assert sched.kv.num_used_blocks == 0, "blocks leaked"
    sched.kv.check_invariants()
    return outputs, finals


def chunk_tokens(ch: p.SeqChunk) -> int:
    return len(ch.token_ids) or 1


@pytest.mark.parametrize("overlap", [False, True])
def test_batch_matches_reference_and_budget_holds(overlap) -> None:
    sched, worker = make(chunk=16)
    rng = random.Random(0)
    reqs = [request(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))], 20) for i in range(6)]

    def check(plan, _):
        assert sum(chunk_tokens(c) for c in plan.chunks) <= 16

    outputs, finals = run(sched, worker, {0: reqs[:3], 5: reqs[3:]}, check=check, overlap=overlap)
    for r in reqs:
        assert outputs[r.rid] == reference(r.prompt_ids, 20)
        assert finals[r.rid].finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True])
def test_long_prompt_is_chunked_in_order_and_decodes_keep_running(overlap) -> None:
    sched, worker = make(chunk=8)
    short = request("short", [1, 2, 3], 30)
    long = request("long", list(range(1, 60)), 5)
    seen_chunks = []

    def check(plan, s):
        if "short" in s.requests and s.requests["short"].output_ids and "short" in [
            r.rid for r in s.running
        ]:
            # once decoding, 'short' is in every step (never starved by the long prefill)
            slots = {c.slot for c in plan.chunks}
            assert s.requests["short"].slot in slots
        for c in plan.chunks:
            if c.token_ids and len(c.token_ids) > 1:
                seen_chunks.append(c.token_ids)

    outputs, _ = run(sched, worker, {0: [short], 2: [long]}, check=check, overlap=overlap)
    assert outputs["long"] == reference(long.prompt_ids, 5)
    assert outputs["short"] == reference(short.prompt_ids, 30)
    flat = [t for c in seen_chunks for t in c if c != [1, 2, 3]]
    assert flat == long.prompt_ids  # the chunks cover the prompt exactly, in order


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_under_a_tiny_pool_keeps_outputs_identical(overlap) -> None:
    sched, worker = make(num_blocks=12, block_size=4, chunk=64)
    rng = random.Random(1)
    reqs = [request(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(10)], 25) for i in range(5)]
    outputs, _ = run(sched, worker, {0: reqs}, overlap=overlap)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert outputs[r.rid] == reference(r.prompt_ids, 25)


def test_prefix_cache_hit_reports_cached_tokens_and_same_output() -> None:
    sched, worker = make(block_size=4)
    shared = list(range(1, 18))
    first = request("a", shared + [40, 41], 6)
    second = request("b", shared + [50], 6)
    _, finals = run(sched, worker, {0: [first], 30: [second]})
    assert finals["a"].cached_tokens == 0
    assert finals["b"].cached_tokens == 16
    outputs, _ = run(*make(prefix=False), {0: [request("b", shared + [50], 6)]})
    assert outputs["b"] == reference(second.prompt_ids, 6)


def test_no_chunking_prefills_whole_prompts() -> None:
    sched, worker = make(chunk=-1, max_prefill=256)

    def check(plan, _):
        assert all(len(c.token_ids) != 100 or c.sample for c in plan.chunks)

    long = request("long", list(range(1, 97)) + [1, 2, 3, 4], 3)
    outputs, _ = run(sched, worker, {0: [long]}, check=check)
    assert outputs["long"] == reference(long.prompt_ids, 3)
    with pytest.raises(ValueError, match="--max-prefill-tokens"):
        make(chunk=-1, max_prefill=100, max_len=256)


def test_request_that_can_never_fit_is_rejected() -> None:
    sched, _ = make(num_blocks=4, block_size=4, max_len=256)
    with pytest.raises(AdmissionError, match="pool holds 16"):
        sched.add_request(request("big", list(range(1, 10)), 10))
    with pytest.raises(AdmissionError, match="max-model-len"):
        sched.add_request(request("long", [1] * 256, 1))


def test_stop_token_eos_min_tokens_and_abort() -> None:
    sched, worker = make()
    target = reference([5, 6, 7], 4)[2]
    sched.add_request(request("stop", [5, 6, 7], 20, stop_token_ids=[target]))
    sched.add_request(request("gone", [9, 9, 9], 50))
    outputs: dict[str, list[int]] = {}
    finals = {}
    for _ in range(3):
        for d in sched.process_result(worker.execute(sched.schedule())):
            outputs.setdefault(d.rid, []).extend(d.token_ids)
            if d.finish_reason:
                finals[d.rid] = d
    assert finals["stop"].finish_reason == "stop" and finals["stop"].matched_stop == target
    assert outputs["stop"] == reference([5, 6, 7], 3)
    delta = sched.abort("gone")
    assert delta is not None and delta.finish_reason == "abort"
    assert sched.kv.num_used_blocks == 0
    plan = sched.schedule()  # the freed slots still reach the worker
    assert plan is not None and sorted(plan.free_slots) == sorted(worker.slots)
    assert sched.process_result(worker.execute(plan)) == []
    assert sched.schedule() is None and not sched.has_work()


def test_overlap_never_schedules_past_max_tokens_and_voids_work_after_eos() -> None:
    sched, worker = make()
    # Finishes by length: the scheduler must not plan a decode beyond max_new_tokens.
    sched.add_request(request("len", [3, 4, 5], 2))
    planned = 0
    pending = []
    for _ in range(6):
        plan = sched.schedule()
        if plan is not None:
            planned += sum(1 for c in plan.chunks if c.sample)
            pending.append(worker.execute(plan))
        if pending and (plan is None or len(pending) == 2):
            sched.process_result(pending.pop(0))
    assert planned == 2 and not sched.has_work()
    # Finishes by a stop id: the one step planned past it is void and its token never emitted.
    target = reference([5, 6, 7], 2)[1]
    outputs, finals = run(*make(), {0: [request("stop", [5, 6, 7], 20, stop_token_ids=[target])]}, overlap=True)
    assert outputs["stop"] == reference([5, 6, 7], 2) and finals["stop"].finish_reason == "stop"
