"""bench latency's pipelined decode loop: each step launched before the one before it is finished."""

from __future__ import annotations

from app.bench.latency import pipelined_step_ms
from app.protocol import SeqChunk, StepPlan


class RecordingRunner:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.launched = 0

    def launch(self, plan: StepPlan) -> int:
        self.launched += 1
        self.events.append(f"launch {self.launched}")
        return self.launched

    def finish(self, pending: int) -> None:
        self.events.append(f"finish {pending}")


def test_each_step_is_launched_before_the_one_before_it_is_read() -> None:
    runner = RecordingRunner()
    ms = pipelined_step_ms(runner, StepPlan(step=1, chunks=[SeqChunk(0)]), 3)
    assert ms is not None and ms >= 0
    assert runner.events == ["launch 1", "launch 2", "finish 1", "launch 3", "finish 2", "finish 3"]


def test_fewer_than_two_steps_are_not_timed() -> None:
    runner = RecordingRunner()
    assert pipelined_step_ms(runner, StepPlan(step=1, chunks=[SeqChunk(0)]), 1) is None
    assert runner.events == []
