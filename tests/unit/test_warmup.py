"""`tokenspeed warmup` (app/warmup.py): one worker's start-up in process with dummy weights, kernel builds
allowed; on the CPU it runs the same path (no kernel to build) and reports the phases and the caches."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import warmup
from tests.support.model_factory import build_tiny_model


def test_warmup_runs_a_start_and_reports_the_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capfd: pytest.CaptureFixture) -> None:
    model = build_tiny_model("llama", tmp_path / "llama", seed=1)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "")  # restored after the test (prepare() sets it for Hub models)
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "k.cubin").write_bytes(b"x" * 2_000_000)
    assert warmup.run([str(model), "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "2"]) == 0
    log = capfd.readouterr().err  # the command configures logging to stderr itself
    line = next(x for x in log.splitlines() if "kernels built in" in x)
    for phase in ("weights", "kernels", "memory_profile", "graph_capture", "warmup"):
        assert f"{phase} " in line, line
    assert f"triton {tmp_path / 'triton'} (2 MB)" in line
    assert "attention backend torch" in log


def test_warmup_refuses_what_it_cannot_build(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert warmup.run([str(tmp_path), "--device", "cpu", "--tensor-parallel-size", "2"]) == 1
    assert "--tensor-parallel-size 2" in capsys.readouterr().err
    assert warmup.run(["/nonexistent/models/m", "--device", "cpu"]) == 1
