"""`tokenspeed bench`: names its benchmarks, refuses unknown ones, hands the rest of the line to one."""

from __future__ import annotations

import sys
import types

import pytest

from app import cli


def test_bench_lists_its_benchmarks_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("serving", "offline", "latency"))
    assert cli.main(["bench"]) == 2
    assert "a benchmark name is required" in capsys.readouterr().err
    assert cli.main(["bench", "throughput"]) == 2
    assert "unknown benchmark 'throughput'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "bench serving|offline|latency" in capsys.readouterr().out


def test_bench_runs_the_named_benchmark_with_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    fake = types.SimpleNamespace(main=lambda argv: calls.append(argv))
    monkeypatch.setitem(sys.modules, "app.bench.offline", fake)
    assert cli.main(["bench", "offline", "--num-requests", "3"]) == 0
    assert calls == [["--num-requests", "3"]]
    monkeypatch.setitem(sys.modules, "app.bench.offline", types.SimpleNamespace(main=lambda argv: 4))
    assert cli.main(["bench", "offline"]) == 4  # a benchmark's own exit status comes through


def test_bench_serving_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "serving", "--help"]) == 0
    assert "--base-url" in capsys.readouterr().out
    assert cli.main(["bench", "serving", "--random-range-ratio", "2"]) == 2


def test_bench_serving_without_httpx_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delitem(sys.modules, "app.bench.serving", raising=False)
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx now raises ModuleNotFoundError
    assert cli.main(["bench", "serving"]) == 2
    assert "pip install 'tokenspeed-appliance[bench]'" in capsys.readouterr().err
