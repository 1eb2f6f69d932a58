"""app/bench/offline.py: the overlapped drive (two steps in flight, StepPipeline) produces the same
greedy tokens as the sequential one, and those are the model's greedy continuations.

A tiny random Llama on the CPU; the KV pool is smaller than the requests' total need and prompts span
several prefill chunks, so admissions, chunked prefill, preemption and recompute all happen in both
drives (the two plan differently: the overlapped scheduler plans before the previous step's tokens
are known).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from app.bench import offline as bench_offline
from app.bench.latency import runner_settings
from app.protocol import StepPlan, StepResult
from app.scheduler.scheduler import Scheduler, SchedulerConfig
from app.worker.model_runner import ModelRunner
from tests.support.model_factory import build_tiny_model

NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = 12, 24, 12
# 4 slots of 36 tokens (3 blocks of 16 each) against a 9-block pool: preemption is certain.
FLAGS = (
    f"--num-requests {NUM_REQUESTS} --input-len {INPUT_LEN} --output-len {OUTPUT_LEN} --max-num-seqs 4 "
    "--chunked-prefill-size 32 --max-total-tokens 144 --device cpu"
).split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("bench_offline") / "llama")


def args_for(model_dir: Path, *extra: str):
    return bench_offline.parse_args(["--model", str(model_dir), *FLAGS, *extra])


def test_run_gives_the_same_tokens_with_and_without_overlap(model_dir: Path) -> None:
    overlapped = bench_offline.run(args_for(model_dir, "--profile-steps", "3:4"))
    sequential = bench_offline.run(args_for(model_dir, "--no-overlap"))
    assert (overlapped["overlap"], sequential["overlap"]) == (True, False)
    for result in (overlapped, sequential):
        assert result["finished"] == NUM_REQUESTS
        assert result["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
        assert result["preemptions"] > 0  # the scenario covers recompute after preemption
        assert result["kv_pool_tokens"] == 144
    assert overlapped["output_sha256"] == sequential["output_sha256"]
    for result in (overlapped, sequential):  # every step is timed under its kind
        kinds = result["step_kinds"]
        assert set(kinds) == {"decode", "mixed"}
        assert sum(kind["steps"] for kind in kinds.values()) == result["steps"]
        assert 0 < sum(kind["seconds"] for kind in kinds.values()) <= result["elapsed_s"] * 1.01
    profile = overlapped["profile"]  # on the CPU there are no kernels: the window itself is what is checked
    assert profile["steps"] == 4 and profile["wall_ms"] > 0 and profile["kernels"] == []


def greedy_reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers, full forward per token, argmax (EOS does not stop it: the benchmark ignores EOS)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


class CallLog:
    """A ModelRunner that records the order of its launches and finishes, by step number."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.calls: list[tuple[str, int]] = []

    def launch(self, plan: StepPlan) -> Any:
        self.calls.append(("launch", plan.step))
        return self.runner.launch(plan)

    def finish(self, pending: Any) -> StepResult:
        self.calls.append(("finish", pending.step))
        return self.runner.finish(pending)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))


def test_both_drives_give_every_request_the_models_greedy_tokens(model_dir: Path) -> None:
    args = args_for(model_dir)
    settings = runner_settings(args, max_num_seqs=args.max_num_seqs, max_model_len=INPUT_LEN + OUTPUT_LEN,
                               chunked_prefill_size=args.chunked_prefill_size)  # fmt: skip
    runner = ModelRunner(settings, torch.device("cpu"))
    config = SchedulerConfig.from_settings(settings, runner.ready_message())
    requests = bench_offline.make_requests(args, runner.vocab_size)
    outcomes, calls = {}, {}
    for overlap, drive in bench_offline.DRIVERS.items():
        scheduler = Scheduler(config)
        for request in requests:
            scheduler.add_request(request)
        outcomes[overlap] = outcome = bench_offline.Outcome()
        logged = CallLog(runner)
        with torch.inference_mode():
            drive(scheduler, logged, outcome)
        calls[overlap] = logged.calls
        assert outcome.finished == NUM_REQUESTS and scheduler.num_preemptions > 0
        assert not scheduler.has_work() and scheduler.num_inflight_steps == 0
    # Sequential: each step finishes before the next launches. Overlapped: step N+1 is launched before
    # step N is finished, except where the scheduler had nothing more to plan until N came back.
    assert calls[False] == [
        (what, step) for step in range(outcomes[False].steps) for what in ("launch", "finish")
    ]
    log = calls[True]
    ahead = [
        i for i, (what, step) in enumerate(log) if what == "finish" and log[i - 1] == ("launch", step + 1)
    ]
    assert len(ahead) >= 0.8 * outcomes[True].steps  # measured: 52 of 54
    assert outcomes[True].outputs == outcomes[False].outputs
    assert outcomes[True].steps > 0 and outcomes[False].steps > 0
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for request in requests[:3]:
        expected = greedy_reference(reference, request.prompt_ids, OUTPUT_LEN)
        assert outcomes[True].outputs[request.rid] == expected
    assert len({tuple(ids) for ids in outcomes[True].outputs.values()}) > 1  # not one collapsed answer


def test_idle_gaps_are_summed_per_pair_of_neighbours() -> None:
    """The profile's idle report: gaps between device events by GPU time, overlapping events (another
    stream) closing no gap, largest first."""
    from types import SimpleNamespace

    def event(start: float, end: float, name: str) -> Any:
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), name=name)

    events = [event(0, 10, "a"), event(15, 20, "b"), event(20, 30, "c"), event(25, 28, "d"), event(40, 50, "a"),
              event(55, 60, "b"), event(100, 101, "c")]  # fmt: skip
    gaps = bench_offline.idle_gaps(events)
    assert [(g["before"], g["after"], g["count"]) for g in gaps] == [("b", "c", 1), ("a", "b", 2), ("c", "a", 1)]
    assert gaps[0]["ms"] == pytest.approx(0.040) and gaps[1]["ms"] == pytest.approx(0.010)
    assert bench_offline.idle_gaps([]) == []


def test_host_calls_during_the_longest_gap() -> None:
    """The host-side events that overlap the GPU's longest idle gap, by their time inside it."""
    from types import SimpleNamespace

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(start: float, end: float, name: str, device: Any) -> Any:
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), name=name, device_type=device)

    kernels = [event(0, 10, "k1", cuda), event(12, 20, "k2", cuda), event(60, 70, "k3", cuda)]
    host = [event(5, 11, "before", cpu), event(15, 45, "sync", cpu), event(40, 80, "launch", cpu),
            event(71, 90, "after", cpu)]  # fmt: skip
    calls = bench_offline.host_during_longest_gap([*kernels, *host], kernels)
    assert [(c["name"], c["ms"]) for c in calls] == [("sync", 0.025), ("launch", 0.020)]
    assert bench_offline.host_during_longest_gap([], []) == []
