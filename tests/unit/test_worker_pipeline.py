"""The worker's pipelined steps: ModelRunner.launch / finish and serve_steps, against plain execute.

The plans are scripted in advance, as the scheduler sends them with two steps in flight: they depend
on how many tokens each sequence has produced, never on which (a decode feeds the worker's own token),
so the same list can be run unpipelined and pipelined and the results must be identical. The script
joins sequences mid-run, chunks prefills, frees slots and blocks and reuses them for sequences with
other sampling parameters (seeded and unseeded draws, top-k, top-p, penalties, logit bias, logprobs)
while earlier steps are still pending.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from app import ipc
from app.ipc import Endpoints
from app.protocol import NewSeq, SamplingParams, SeqChunk, Shutdown, StepPlan, StepResult
from app.worker.model_runner import ModelRunner
from app.worker.process import serve_steps
from app.worker.readback import PendingStep
from tests.support.model_factory import build_tiny_model

CPU = torch.device("cpu")


@dataclass
class Seq:
    rid: str
    prompt_len: int
    max_new: int
    join: int
    sampling: SamplingParams
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    fed: int = 0  # prompt tokens sent
    produced: int = 0  # tokens the plans so far will have sampled
    done: bool = False


def sequence_mix() -> list[Seq]:
    """More sequences than slots, joining over time, with every sampling path the sampler has."""
    mix = [
        ("greedy", 21, 9, 0, SamplingParams(temperature=0.0)),
        ("seeded-top-k", 6, 7, 0, SamplingParams(temperature=0.8, top_k=20, seed=7)),
        ("unseeded", 30, 6, 1, SamplingParams(temperature=1.0)),
        ("top-p", 5, 8, 2, SamplingParams(temperature=0.7, top_p=0.9)),
        ("logprobs", 11, 6, 3, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)),
        ("penalised", 9, 8, 4, SamplingParams(temperature=0.9, seed=3, logprobs=True, presence_penalty=0.5,
                                              repetition_penalty=1.2, logit_bias={5: 2.0}, min_new_tokens=2)),
        ("late-greedy", 17, 5, 6, SamplingParams(temperature=0.0, logprobs=True)),
    ]  # fmt: skip
    return [Seq(rid, n, new, join, params) for rid, n, new, join, params in mix]


class PlanScript:
    """The plans a scheduler would send: decodes first, then admissions and prefill chunks within a
    token budget; a sequence that has sampled its last token is freed in the next plan, its slot and
    blocks reusable from the plan after that (the runner releases freed slots after the step)."""

    def __init__(self, seqs: list[Seq], vocab: int, max_slots: int, num_blocks: int, block_size: int,
                 budget: int) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        self.seqs = seqs
        self.prompts = {s.rid: torch.randint(3, vocab, (s.prompt_len,), generator=gen).tolist() for s in seqs}
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.free_slots = list(range(max_slots))
        self.block_size = block_size
        self.budget = budget
        self.to_free: list[Seq] = []

    def plans(self) -> list[StepPlan]:
        plans: list[StepPlan] = []
        while not all(s.done for s in self.seqs) or self.to_free:
            plans.append(self._plan(len(plans)))
            assert len(plans) < 500, "the script made no progress"
        return plans

    def _plan(self, step: int) -> StepPlan:
        plan = StepPlan(step=step, free_slots=[s.slot for s in self.to_free])
        released, self.to_free = self.to_free, []
        room = self._decodes(plan, self.budget)
        self._prefills(plan, room)
        self._count_samples(plan)
        for seq in released:
            self.free_slots.append(seq.slot)
            self.free_blocks += seq.blocks
            seq.slot, seq.blocks = -1, []
        return plan

    def _decodes(self, plan: StepPlan, room: int) -> int:
        """One token for every prefilled sequence, fed by the worker; returns the budget left."""
        for seq in self.seqs:
            if seq.slot >= 0 and not seq.done and seq.fed == seq.prompt_len:
                plan.chunks.append(SeqChunk(seq.slot, [], self._grow(seq, seq.prompt_len + seq.produced)))
                room -= 1
        return room

    def _prefills(self, plan: StepPlan, room: int) -> None:
        for seq in self.seqs:
            if room <= 0:
                return
            if seq.slot < 0 and not seq.done and seq.join <= plan.step and self.free_slots:
                seq.slot = self.free_slots.pop(0)
                blocks = self._grow(seq, min(room, seq.prompt_len))  # its first chunk's, in the NewSeq
                plan.new_seqs.append(NewSeq(seq.slot, seq.rid, seq.sampling, seq.prompt_len, blocks,
                                            prompt_ids=self.prompts[seq.rid]))  # fmt: skip
            if seq.slot >= 0 and seq.fed < seq.prompt_len:
                n = min(room, seq.prompt_len - seq.fed)
                tokens = self.prompts[seq.rid][seq.fed : seq.fed + n]
                seq.fed += n
                sample = seq.fed == seq.prompt_len
                plan.chunks.append(SeqChunk(seq.slot, tokens, self._grow(seq, seq.fed), sample=sample))
                room -= n

    def _count_samples(self, plan: StepPlan) -> None:
        for chunk in plan.chunks:
            if chunk.sample:
                seq = next(s for s in self.seqs if s.slot == chunk.slot and not s.done)
                seq.produced += 1
                if seq.produced == seq.max_new:
                    seq.done = True
                    self.to_free.append(seq)

    def _grow(self, seq: Seq, context: int) -> list[int]:
        """Blocks to append so that `context` tokens fit."""
        need = max(math.ceil(context / self.block_size) - len(seq.blocks), 0)
        taken = [self.free_blocks.pop(0) for _ in range(need)]
        seq.blocks += taken
        return taken


def make_runner(model_dir: Path, **overrides: Any) -> ModelRunner:
    from tests.unit.test_model_runner import make_settings

    fields = {"max_num_seqs": 4, "seed": 0, **overrides}
    return ModelRunner(make_settings(model_dir, **fields), CPU)


def plans_for(runner: ModelRunner) -> list[StepPlan]:
    script = PlanScript(sequence_mix(), runner.vocab_size, runner.max_num_seqs, runner.pool.num_blocks,
                        runner.block_size, budget=16)  # fmt: skip
    return script.plans()


def run_plain(runner: Any, plans: list[StepPlan]) -> list[StepResult]:
    return [runner.execute(plan) for plan in plans]


def run_pipelined(runner: Any, plans: list[StepPlan], depth: int) -> list[StepResult]:
    """Launch up to `depth` steps beyond the oldest unfinished one before finishing it."""
    pending: deque[PendingStep] = deque()
    results = []
    for plan in plans:
        pending.append(runner.launch(plan))
        if len(pending) > depth:
            results.append(runner.finish(pending.popleft()))
    results += [runner.finish(step) for step in pending]
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=5)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[StepResult]:
    """The unpipelined run of the script, on a fresh runner."""
    runner = make_runner(model_dir)
    return run_plain(runner, plans_for(runner))


def test_the_script_covers_what_pipelining_must_survive(model_dir: Path, reference: list[StepResult]) -> None:
    runner = make_runner(model_dir)
    plans = plans_for(runner)
    owners: dict[int, set[str]] = {}
    for plan in plans:
        for seq in plan.new_seqs:
            owners.setdefault(seq.slot, set()).add(seq.rid)
    assert any(len(rids) > 1 for rids in owners.values())  # slots freed and reused
    assert any(not chunk.sample for plan in plans for chunk in plan.chunks)  # chunked prefill
    assert any(
        plan.new_seqs and any(not c.token_ids for c in plan.chunks) for plan in plans
    )  # joins mid-decode
    assert all(r.error is None and not r.bad_slots for r in reference)
    produced: dict[str, int] = {}
    rid_of = {}
    for plan, result in zip(plans, reference, strict=True):
        rid_of.update({seq.slot: seq.rid for seq in plan.new_seqs})
        for slot in result.slots:
            produced[rid_of[slot]] = produced.get(rid_of[slot], 0) + 1
    assert produced == {s.rid: s.max_new for s in sequence_mix()}
    assert any(result.logprobs for result in reference)


@pytest.mark.parametrize("depth", [1, 3])
def test_pipelined_steps_give_the_same_results(
    model_dir: Path, reference: list[StepResult], depth: int
) -> None:
    runner = make_runner(model_dir)
    assert run_pipelined(runner, plans_for(runner), depth) == reference
    assert not any(runner.slots.active)


def test_finish_reads_only_what_launch_captured(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    wants = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    first = runner.launch(
        StepPlan(0, [NewSeq(0, "a", wants, 3, [0])], [SeqChunk(0, [4, 5, 6])], free_slots=[0])
    )
    # Slot 0 is released and taken by a sequence without logprobs before step 0 is read back.
    second = runner.launch(StepPlan(1, [NewSeq(0, "b", SamplingParams(temperature=0.0), 2, [1])],
                                    [SeqChunk(0, [7, 8])]))  # fmt: skip
    assert isinstance(first, PendingStep) and first.ready()
    one, two = runner.finish(first), runner.finish(second)
    assert one.slots == [0] and len(one.logprobs) == 1 and one.logprobs[0].token_id == one.token_ids[0]
    assert len(one.logprobs[0].top_ids) == 2
    assert two.slots == [0] and two.logprobs == []


def test_a_plan_without_chunks_or_samples_finishes_empty(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    seq = NewSeq(1, "a", SamplingParams(temperature=0.0), 8, [0, 1])
    assert runner.finish(runner.launch(StepPlan(4, [seq]))) == StepResult(step=4)
    no_sample = StepPlan(5, chunks=[SeqChunk(1, [3, 4, 5], sample=False)])
    assert runner.finish(runner.launch(no_sample)) == StepResult(step=5)
    assert runner.slots.seq_len[1] == 3


# ---------------------------------------------------------------- no readback while launching

# Tensor methods that bring device data to the host (a sync on CUDA). On the CPU nothing syncs, so the
# test refuses them outright while the sampler runs: its host-side work is numpy, its tensors are all
# device tensors. The GPU test checks whole launches with torch's sync debug mode.
READBACKS = ("item", "tolist", "__bool__", "nonzero", "cpu", "numpy", "__int__", "__float__", "__index__")


def _refuse(name: str) -> Any:
    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"Tensor.{name} reads the device")

    return refuse


def _sample_refusing_readbacks(
    monkeypatch: pytest.MonkeyPatch, params: list[SamplingParams], vocab: int = 64
) -> Any:
    from app.worker.sampling import Sampler

    sampler = Sampler(vocab, [vocab - 1], CPU, len(params), seed=0)
    for slot, p in enumerate(params):
        sampler.add_seq(slot, f"r{slot}", p, [1, 2, 3], [4])
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(0))
    with monkeypatch.context() as patched:
        for name in READBACKS:
            patched.setattr(torch.Tensor, name, _refuse(name))
        return sampler.sample(logits, list(range(len(params))))


def test_sampling_reads_nothing_back_on_the_common_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4),
        SamplingParams(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.3, frequency_penalty=0.2,
                       logit_bias={7: 3.0}, min_new_tokens=3, logprobs=True),
    ]  # fmt: skip
    out = _sample_refusing_readbacks(monkeypatch, params)
    assert out.bad.tolist() == [False] * len(params) and out.bad_rows == []
    logprobs = out.logprobs
    assert [lp is not None for lp in logprobs] == [False, False, False, False, True, True]
    assert logprobs[4].token_id == out.token_ids[4].item() and len(logprobs[4].top_ids) == 4


def test_top_p_without_top_k_is_the_one_sampling_path_that_reads_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(AssertionError, match="Tensor.__bool__ reads the device"):
        # Over a vocabulary wider than the partial sort, whose coverage is then checked.
        _sample_refusing_readbacks(monkeypatch, [SamplingParams(temperature=0.7, top_p=0.9)], vocab=5000)


# ---------------------------------------------------------------- serve_steps over ipc:// sockets


class Recorder:
    """Delegates to a runner, recording the order of launch and finish calls; raises on request."""

    def __init__(self, runner: Any, fail_launch: int | None = None, fail_finish: int | None = None) -> None:
        self.runner = runner
        self.fail_launch = fail_launch
        self.fail_finish = fail_finish
        self.calls: list[tuple[str, int]] = []

    def launch(self, plan: StepPlan) -> Any:
        self.calls.append(("launch", plan.step))
        if plan.step == self.fail_launch:
            raise RuntimeError(f"injected launch failure in step {plan.step}")
        return self.runner.launch(plan)

    def finish(self, pending: PendingStep) -> StepResult:
        self.calls.append(("finish", pending.step))
        if pending.step == self.fail_finish:
            raise RuntimeError(f"injected finish failure in step {pending.step}")
        return self.runner.finish(pending)


class Sockets:
    """The worker's inbox and the scheduler's result inbox as ipc:// endpoints in a temp dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.endpoints = Endpoints(str(tmp_path))
        self.ctx = zmq.Context()
        self.inbox = ipc.bind_pull(self.ctx, self.endpoints.inbox("worker"))
        self.results_in = ipc.bind_pull(self.ctx, self.endpoints.inbox("scheduler_results"))
        self.results = ipc.connect_push(self.ctx, self.endpoints.inbox("scheduler_results"))

    def queue(self, messages: list[Any]) -> None:
        """Deliver every message to the inbox before the worker starts (a sender context flushed on term)."""
        sender_ctx = zmq.Context()
        to_worker = ipc.connect_push(sender_ctx, self.endpoints.inbox("worker"))
        for msg in messages:
            ipc.send(to_worker, msg)
        to_worker.close(linger=5000)
        sender_ctx.term()
        assert self.inbox.poll(5000)
        time.sleep(0.1)  # the receiving side's I/O thread queues the rest

    def take_results(self) -> list[StepResult]:
        out = []
        while self.results_in.poll(200):
            out.append(ipc.recv(self.results_in))
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def sockets(tmp_path: Path):
    s = Sockets(tmp_path)
    yield s
    s.close()


def serve_queued(runner: Any, plans: list[StepPlan], sockets: Sockets) -> list[StepResult]:
    sockets.queue([*plans, Shutdown("done")])
    serve_steps(runner, sockets.inbox, sockets.results)
    return sockets.take_results()


def test_serve_steps_pipelines_queued_plans_and_keeps_step_order(
    model_dir: Path, reference: list[StepResult], sockets: Sockets
) -> None:
    runner = make_runner(model_dir)
    recorder = Recorder(runner)
    results = serve_queued(recorder, plans_for(runner), sockets)
    assert results == reference
    calls = recorder.calls
    for step in range(len(reference) - 1):  # step N+1 was launched before step N's result was read
        assert calls.index(("launch", step + 1)) < calls.index(("finish", step)), calls[: 2 * step + 4]



def test_without_overlap_each_step_is_sent_before_the_next_is_launched(
    model_dir: Path, reference: list[StepResult], sockets: Sockets
) -> None:
    """The CPU worker's order: a launch computes the whole step, so its result goes out at once."""
    runner = make_runner(model_dir)
    recorder = Recorder(runner)
    sockets.queue([*plans_for(runner), Shutdown("done")])
    serve_steps(recorder, sockets.inbox, sockets.results, overlap=False)
    assert sockets.take_results() == reference
    calls = recorder.calls
    for step in range(len(reference) - 1):
        assert calls.index(("finish", step)) < calls.index(("launch", step + 1)), calls[: 2 * step + 4]

def test_a_failed_launch_still_sends_the_previous_step_first(
    model_dir: Path, reference: list[StepResult], sockets: Sockets
) -> None:
    runner = make_runner(model_dir)
    plans = plans_for(runner)
    failing = 6
    recorder = Recorder(runner, fail_launch=failing)
    results = serve_queued(recorder, plans[: failing + 2], sockets)
    assert [r.step for r in results] == list(range(failing + 2))
    assert results[:failing] == reference[:failing]
    assert results[failing].error == f"RuntimeError: injected launch failure in step {failing}"
    assert recorder.calls.index(("launch", failing)) < recorder.calls.index(("finish", failing - 1))


def test_a_failed_finish_fails_only_its_step(
    model_dir: Path, reference: list[StepResult], sockets: Sockets
) -> None:
    runner = make_runner(model_dir)
    plans = plans_for(runner)
    failing = 5
    results = serve_queued(Recorder(runner, fail_finish=failing), plans, sockets)
    assert [r.step for r in results] == [plan.step for plan in plans]
    assert results[failing].error == f"RuntimeError: injected finish failure in step {failing}"
    assert results[:failing] == reference[:failing]
    assert (
        results[failing + 1 :] == reference[failing + 1 :]
    )  # the step was computed, only its readback failed


class SlowDevice:
    """A runner double whose step N stays busy on the 'device' until step N+1 is launched, or until
    `busy_s` has passed, whichever comes first."""

    def __init__(self, busy_s: float) -> None:
        self.busy_s = busy_s
        self.calls: list[tuple[str, int]] = []
        self.launched: set[int] = set()

    def launch(self, plan: StepPlan) -> Any:
        self.calls.append(("launch", plan.step))
        self.launched.add(plan.step)
        return _SlowStep(self, plan.step, time.monotonic() + self.busy_s)

    def finish(self, pending: _SlowStep) -> StepResult:
        self.calls.append(("finish", pending.step))
        return StepResult(step=pending.step, slots=[0], token_ids=[pending.step])


@dataclass
class _SlowStep:
    device: SlowDevice
    step: int
    done_at: float

    def ready(self) -> bool:
        return self.step + 1 in self.device.launched or time.monotonic() >= self.done_at


def _serve_in_background(runner: Any, sockets: Sockets) -> threading.Thread:
    thread = threading.Thread(target=serve_steps, args=(runner, sockets.inbox, sockets.results), daemon=True)
    thread.start()
    return thread


def test_a_plan_arriving_while_a_step_runs_is_launched_before_that_step_is_read(sockets: Sockets) -> None:
    device = SlowDevice(busy_s=10.0)
    sender = ipc.connect_push(sockets.ctx, sockets.endpoints.inbox("worker"))
    ipc.send(sender, StepPlan(step=0))
    worker = _serve_in_background(device, sockets)
    time.sleep(0.1)  # step 0 is running
    ipc.send(sender, StepPlan(step=1))
    assert sockets.results_in.poll(5000)  # step 0's result, once step 1 is queued behind it
    ipc.send(sender, Shutdown())
    worker.join(15)
    assert not worker.is_alive()
    assert device.calls[:3] == [("launch", 0), ("launch", 1), ("finish", 0)]
    assert [r.step for r in [ipc.recv(sockets.results_in), *sockets.take_results()]] == [0, 1]


def test_a_finished_step_is_sent_without_waiting_for_the_next_plan(sockets: Sockets) -> None:
    device = SlowDevice(busy_s=0.05)
    sender = ipc.connect_push(sockets.ctx, sockets.endpoints.inbox("worker"))
    ipc.send(sender, StepPlan(step=0))
    worker = _serve_in_background(device, sockets)
    try:
        assert sockets.results_in.poll(5000)
        assert ipc.recv(sockets.results_in).step == 0 and device.calls == [("launch", 0), ("finish", 0)]
    finally:
        ipc.send(sender, Shutdown())
        worker.join(15)
    assert not worker.is_alive()


class FaultyDevice(SlowDevice):
    """Step 0 hits a device fault: asking whether it is done raises, and so does reading it."""

    def launch(self, plan: StepPlan) -> Any:
        pending = super().launch(plan)
        if plan.step == 0:
            pending.ready = _device_fault
        return pending

    def finish(self, pending: _SlowStep) -> StepResult:
        if pending.step == 0:
            _device_fault()
        return super().finish(pending)


def _device_fault() -> bool:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_device_fault_fails_its_step_and_the_worker_goes_on(sockets: Sockets) -> None:
    device = FaultyDevice(busy_s=0.0)
    sender = ipc.connect_push(sockets.ctx, sockets.endpoints.inbox("worker"))
    ipc.send(sender, StepPlan(step=0, chunks=[SeqChunk(0, [1])]))
    worker = _serve_in_background(device, sockets)
    try:
        assert sockets.results_in.poll(5000)
        failed = ipc.recv(sockets.results_in)
        ipc.send(sender, StepPlan(step=1, chunks=[SeqChunk(0, [1])]))
        assert sockets.results_in.poll(5000)
        assert ipc.recv(sockets.results_in) == StepResult(step=1, slots=[0], token_ids=[1])
    finally:
        ipc.send(sender, Shutdown())
        worker.join(15)
    assert not worker.is_alive()
    assert (
        failed.step == 0
        and failed.error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
