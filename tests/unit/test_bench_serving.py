"""app/bench/serving.py against a tiny fake OpenAI server (a real uvicorn in a thread) that streams
exactly max_tokens tokens and reports as prompt_tokens the number of ids (or words) it was sent; and
scripts/gpu/serve_and_bench.sh's RANGE_RATIO, run with stand-ins for python3 and curl.

Covers --random-range-ratio: R=0 keeps fixed lengths and the prompts of the generator before the flag,
R>0 draws lengths inside the range, varied and reproducible for a seed, and bad values are rejected.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.bench import serving as bench_serving
from tests.support.threaded_server import ThreadedServer

ROOT = Path(__file__).resolve().parents[2]
VOCAB, MIN_ID = 500, 100


class FakeServer(ThreadedServer):
    """/v1/models and a streaming /v1/completions; keeps every request body it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.serving = True  # False: /v1/models answers 503, as an appliance that is not ready
        self.failures = 0  # the next this-many completions fail: 500, then an error inside the stream
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )
        super().__init__(app, lifespan="off")

    async def models(self, request: Request) -> JSONResponse:
        if not self.serving:
            return JSONResponse({"error": {"message": "not ready"}}, status_code=503)
        return JSONResponse({"data": [{"id": "fake"}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        fail, self.failures = self.failures > 0, max(0, self.failures - 1)
        if fail and len(self.bodies) % 2:
            return JSONResponse({"error": {"message": "engine step failed"}}, status_code=500)

        async def events() -> AsyncIterator[str]:
            if fail:
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "w "}]}) + "\n\n"
                yield "data: " + json.dumps({"error": {"message": "the engine failed"}}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            for _ in range(body["max_tokens"]):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "w "}]}) + "\n\n"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server


def bench(fake: FakeServer, *flags: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run (one request in flight, so the server sees them in order): its result and the bodies sent."""
    argv = ["--base-url", fake.url, "--vocab-size", str(VOCAB), "--min-token-id", str(MIN_ID),
            "--max-concurrency", "1", *flags]  # fmt: skip
    fake.bodies.clear()
    result = asyncio.run(bench_serving.run(bench_serving.parse_args(argv)))
    assert result["completed"] == result["num_prompts"] and result["failed"] == 0
    return result, list(fake.bodies)


def prompt_len(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def old_prompts(prompt_type: str, seed: int, num: int, input_len: int) -> list[Any]:
    """The prompts of the generator before --random-range-ratio: one stream from --seed."""
    rng = random.Random(seed)
    if prompt_type == "ids":
        return [[rng.randrange(MIN_ID, VOCAB) for _ in range(input_len)] for _ in range(num)]
    return [" ".join(rng.choice(bench_serving.WORDS) for _ in range(input_len)) for _ in range(num)]


@pytest.mark.parametrize("prompt_type", ["ids", "text"])
@pytest.mark.parametrize("ratio_flags", [[], ["--random-range-ratio", "0"]])
def test_ratio_zero_keeps_fixed_lengths_and_the_earlier_prompts(
    fake: FakeServer, prompt_type: str, ratio_flags: list[str]
) -> None:
    result, bodies = bench(fake, "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--seed", "3",
                           "--prompt-type", prompt_type, *ratio_flags)  # fmt: skip
    assert [body["prompt"] for body in bodies] == old_prompts(prompt_type, 3, 6, 12)
    assert {(body["max_tokens"], body["min_tokens"]) for body in bodies} == {(5, 5)}
    assert {(r["input_len"], r["output_len"], r["prompt_tokens"], r["output_tokens"])
            for r in result["requests"]} == {(12, 5, 12, 5)}  # fmt: skip
    assert result["random_range_ratio"] == 0.0
    assert (result["mean_input_len"], result["mean_output_len"]) == (12, 5)
    assert (result["total_prompt_tokens"], result["total_output_tokens"]) == (72, 30)


@pytest.mark.parametrize("prompt_type", ["ids", "text"])
def test_ratio_draws_varied_lengths_in_range_that_the_requests_carry(
    fake: FakeServer, prompt_type: str
) -> None:
    flags = ["--num-prompts", "24", "--input-len", "16", "--output-len", "8", "--random-range-ratio", "0.5",
             "--prompt-type", prompt_type]  # fmt: skip
    result, bodies = bench(fake, *flags, "--seed", "7")
    inputs = [r["input_len"] for r in result["requests"]]
    outputs = [r["output_len"] for r in result["requests"]]
    assert all(8 <= n <= 24 for n in inputs) and all(4 <= n <= 12 for n in outputs)
    assert len(set(inputs)) > 1 and len(set(outputs)) > 1
    assert [prompt_len(body["prompt"]) for body in bodies] == inputs  # the prompt has the drawn length
    assert [(body["max_tokens"], body["min_tokens"]) for body in bodies] == [(n, n) for n in outputs]
    # The figures come from what the server reported, which here is what was drawn.
    assert [r["prompt_tokens"] for r in result["requests"]] == inputs
    assert [r["output_tokens"] for r in result["requests"]] == outputs
    assert (result["total_prompt_tokens"], result["total_output_tokens"]) == (sum(inputs), sum(outputs))
    assert result["mean_input_len"] == pytest.approx(statistics.fmean(inputs))
    assert result["mean_output_len"] == pytest.approx(statistics.fmean(outputs))
    assert result["output_token_throughput"] == pytest.approx(sum(outputs) / result["duration_s"])
    assert result["random_range_ratio"] == 0.5

    again, bodies_again = bench(fake, *flags, "--seed", "7")
    assert again["requests"] and [(r["input_len"], r["output_len"]) for r in again["requests"]] == list(
        zip(inputs, outputs, strict=True)
    )
    assert [body["prompt"] for body in bodies_again] == [body["prompt"] for body in bodies]
    other, _ = bench(fake, *flags, "--seed", "8")
    assert [r["input_len"] for r in other["requests"]] != inputs


def test_draws_cover_the_whole_inclusive_range() -> None:
    args = bench_serving.parse_args("--num-prompts 2000 --input-len 10 --output-len 4 --random-range-ratio 0.5"
                                    .split())  # fmt: skip
    lengths = bench_serving.draw_lengths(args)
    assert {n for n, _ in lengths} == set(range(5, 16)) and {n for _, n in lengths} == set(range(2, 7))
    assert bench_serving.draw_lengths(args) == lengths


@pytest.mark.parametrize(
    ("length", "ratio", "bounds"),
    [
        (1024, 0.0, (1024, 1024)),
        (100, 0.1, (90, 110)),
        (1000, 0.8, (200, 1800)),
        (3, 0.5, (1, 5)),
        (2, 0.75, (1, 4)),
        (1, 0.9, (1, 2)),
    ],
)
def test_length_bounds(length: int, ratio: float, bounds: tuple[int, int]) -> None:
    assert bench_serving.length_bounds(length, ratio) == bounds  # floor/ceil of exact decimals, at least 1


@pytest.mark.parametrize("value", ["-0.1", "1", "1.5", "nan", "inf", "abc"])
def test_invalid_ratio_is_rejected(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_serving.parse_args(["--random-range-ratio", value])
    assert exc.value.code == 2 and "--random-range-ratio" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--input-len", "--output-len"])
def test_zero_length_is_rejected(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_serving.parse_args([flag, "0"])
    assert flag in capsys.readouterr().err


def test_main_prints_the_summary_and_writes_the_detail(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serving.json"
    assert bench_serving.main(["--base-url", fake.url, "--vocab-size", str(VOCAB), "--num-prompts", "4",
                               "--input-len", "6", "--output-len", "3", "--random-range-ratio", "0.25",
                               "--json", str(out)]) == 0  # fmt: skip
    printed, written = json.loads(capsys.readouterr().out), json.loads(out.read_text())
    assert printed["random_range_ratio"] == written["random_range_ratio"] == 0.25
    assert printed["mean_input_len"] == written["mean_input_len"] is not None
    assert "requests" not in printed and len(written["requests"]) == 4
    assert {key: value for key, value in written.items() if key != "requests"} == printed


def test_failed_requests_fail_the_run_unless_allowed(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    """A refused request (HTTP 500) or one whose stream ends in an error makes the run exit 1, saying so;
    --allow-failures accepts them while one request completed."""
    argv = ["--base-url", fake.url, "--vocab-size", str(VOCAB), "--num-prompts", "4", "--input-len", "4",
            "--output-len", "2", "--max-concurrency", "1"]  # fmt: skip
    fake.bodies.clear()
    fake.failures = 2  # one 500, one error inside the stream
    assert bench_serving.main(argv) == 1
    err = capsys.readouterr().err
    assert "not a valid benchmark: 2 of 4 requests failed" in err and "--allow-failures" in err
    fake.failures = 2
    assert bench_serving.main([*argv, "--allow-failures"]) == 0
    assert json.loads(capsys.readouterr().out)["failed"] == 2
    fake.failures = 4
    assert bench_serving.main([*argv, "--allow-failures"]) == 1
    assert "no request completed (4 failed" in capsys.readouterr().err


def test_a_server_that_is_not_serving_fails_the_run(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    fake.serving = False
    try:
        assert bench_serving.main(["--base-url", fake.url, "--num-prompts", "1"]) == 1
    finally:
        fake.serving = True
    assert "the server is not serving" in capsys.readouterr().err
    assert bench_serving.main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 1  # nothing listens
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize(("env", "passed"), [({}, "0"), ({"RANGE_RATIO": "0.25"}, "0.25")])
def test_serve_and_bench_passes_range_ratio(tmp_path: Path, env: dict[str, str], passed: str) -> None:
    """The script with python3 and curl replaced: the server stand-in sleeps until the script's trap ends it."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        f'#!/bin/bash\necho "$*" >> {log}\n'
        f'case "$1" in -c) exec {sys.executable} "$@" ;; -m) [ "$2" = app.bench.serving ] && exit 0; exec sleep 30 ;; esac\n'
    )
    (bin_dir / "curl").write_text("#!/bin/bash\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    done = subprocess.run(["bash", "scripts/gpu/serve_and_bench.sh", str(tmp_path), "run"], cwd=ROOT,
                          env={"PATH": path, **env}, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    bench_calls = [line.split() for line in log.read_text().splitlines() if "app.bench.serving" in line]
    assert len(bench_calls) == 1
    argv = bench_calls[0]
    assert argv[argv.index("--random-range-ratio") + 1] == passed


@pytest.mark.parametrize(("curl", "bench", "says"), [
    ("exit 7", "exit 0", "appliance not ready after 1 s: no benchmark"),  # readiness never answers 200
    ("exit 0", "exit 1", "failed (exit 1): stopping"),  # bench_serving reports failed requests
])
def test_serve_and_bench_stops_when_not_ready_or_requests_fail(tmp_path: Path, curl: str, bench: str, says: str) -> None:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        f'#!/bin/bash\necho "$*" >> {log}\n'
        f'case "$1" in -c) exec {sys.executable} "$@" ;; -m) [ "$2" = app.bench.serving ] && {{ {bench}; }}; exec sleep 30 ;; esac\n'
    )
    (bin_dir / "curl").write_text(f"#!/bin/bash\n{curl}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    done = subprocess.run(["bash", "scripts/gpu/serve_and_bench.sh", str(tmp_path), "run"], cwd=ROOT,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "READY_TIMEOUT_S": "1", "MORE": "x:1:0:1:1"},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 1 and says in done.stdout, done.stdout
    calls = [line for line in log.read_text().splitlines() if "app.bench.serving" in line]
    assert len(calls) == (0 if "not ready" in says else 1)  # nothing measured past the failure
