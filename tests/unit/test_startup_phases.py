"""Start-up phases (app/startup_phases.py): logged at start and end with seconds, ticking while one runs,
reported as StartupPhase messages in order, summarised for the ready line; the worker's weight load
reports its percentage."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from app import protocol as p
from app.startup_phases import PHASES, StartupClock, StartupProgress, slowest, summary
from app.worker.loader.weights import iterate_tensors


def test_phases_are_logged_reported_and_timed(caplog: pytest.LogCaptureFixture) -> None:
    sent: list[p.StartupPhase] = []
    clock = StartupClock("worker0", sent.append, tick_s=0)
    with caplog.at_level(logging.INFO, logger="tokenspeed.startup"):
        clock.enter("weights")
        time.sleep(0.02)
        clock.enter("kernels")
        seconds = clock.done()
    assert [(m.name, m.phase, m.done) for m in sent] == [
        ("worker0", "weights", False), ("worker0", "weights", True),
        ("worker0", "kernels", False), ("worker0", "kernels", True)]
    assert list(seconds) == ["weights", "kernels"] and seconds["weights"] >= 0.02
    assert sent[1].seconds == seconds["weights"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "start-up phase weights: started"
    assert lines[1].startswith("start-up phase weights: done in ")
    with pytest.raises(ValueError, match="unknown start-up phase 'compile'"):
        clock.enter("compile")


def test_a_running_phase_ticks_with_its_progress(caplog: pytest.LogCaptureFixture) -> None:
    clock = StartupClock("worker0", tick_s=0.02)
    with caplog.at_level(logging.INFO, logger="tokenspeed.startup"):
        clock.enter("weights")
        clock.progress("42% of 16.1 GB")
        time.sleep(0.15)
        clock.done()
        ticks_at_done = sum("running for" in r.getMessage() for r in caplog.records)
        time.sleep(0.06)
    ticks = [r.getMessage() for r in caplog.records if "running for" in r.getMessage()]
    assert ticks and all(t.startswith("start-up phase weights: running for") for t in ticks)
    assert ticks[-1].endswith("(42% of 16.1 GB)")
    assert len(ticks) == ticks_at_done  # done() stops the ticks


def test_a_failing_report_does_not_stop_start_up() -> None:
    def broken(msg: p.StartupPhase) -> None:
        raise OSError("socket closed")

    clock = StartupClock("worker0", broken, tick_s=0)
    clock.enter("warmup")
    assert list(clock.done()) == ["warmup"]


def test_summary_slowest_and_progress() -> None:
    assert summary({"warmup": 0.25, "download": 1.0, "weights": 3.14}) == "download 1.0 s, weights 3.1 s, warmup 0.2 s"
    assert slowest({}) is None
    assert slowest({"worker0": "warmup", "worker1": "memory_profile"}) == "memory_profile"
    progress = StartupProgress()
    assert progress.as_json()["phase"] == "starting"
    progress.apply(p.StartupPhase("worker0", "graph_capture"))
    progress.apply(p.StartupPhase("worker0", "weights", 1.5, True))
    progress.apply(p.StartupPhase("worker1", "weights", 2.0, True))
    body = progress.as_json()
    assert (body["phase"], body["phase_seconds"]) == ("graph_capture", {"weights": 2.0})
    assert list(PHASES) == ["download", "init", "weights", "kernels", "memory_profile", "graph_capture", "warmup"]


def test_startup_phase_crosses_the_wire() -> None:
    msg = p.StartupPhase("worker1", "graph_capture", 3.5, True)
    assert p.decode(p.encode(msg)) == msg


def test_weight_loading_reports_the_fraction_of_bytes_read(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1000), "b": torch.zeros(1000)}, str(tmp_path / "one.safetensors"))
    save_file({"c": torch.zeros(2000)}, str(tmp_path / "two.safetensors"))
    files = [tmp_path / "one.safetensors", tmp_path / "two.safetensors"]
    seen: list[float] = []
    names = [name for name, read in iterate_tensors("safetensors", files, seen.append) if read(None) is not None]
    assert names == ["a", "b", "c"]
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0) and 0.2 < seen[0] < 0.3
