#!/usr/bin/env python3
"""Load generator for any OpenAI-compatible server (in the manner of `vllm bench serve`).

Sends --num-prompts streaming requests to /v1/completions (or /v1/chat/completions with
--endpoint chat) with random prompts of --input-len tokens (token ids, or random words with
--prompt-type text) and exactly --output-len new tokens (max_tokens plus ignore_eos and min_tokens,
which vLLM, SGLang and this appliance accept). With --random-range-ratio R each request's input and
output lengths are drawn uniformly from [floor(L*(1-R)), ceil(L*(1+R))] instead (as vLLM's random
dataset does), reproducibly for --seed. Arrivals are a Poisson process at --request-rate
requests/s (inf: all at once), at most --max-concurrency in flight. Reports TTFT, TPOT, ITL and
end-to-end latency (mean, p50, p90, p99, in ms), request and token throughput (from the lengths the
server reports), mean input and output length; prints that summary and writes it to --json with each
request's drawn and served lengths under "requests". It exits 1, saying why on stderr, when the
server does not serve (/v1/models fails) or any request failed: a benchmark with failed requests
measures something else (--allow-failures accepts them, as long as one request completed).

  tokenspeed bench serving --base-url http://127.0.0.1:8000 --num-prompts 200 \\
      --input-len 512 --output-len 128 --request-rate 8 --json serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx

WORDS = "the of and to in is was for on that with as by at from his her an were are which this be".split()


@dataclass(frozen=True)
class Job:
    """One request to send: its prompt and the lengths drawn for it."""

    prompt: Any
    input_len: int
    output_len: int


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def stats_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ms = [v * 1e3 for v in values]
    return {"mean": statistics.fmean(ms), "p50": statistics.median(ms), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99)}  # fmt: skip


def length_bounds(length: int, ratio: float) -> tuple[int, int]:
    """The inclusive range a request's length is drawn from: floor(L*(1-R)) .. ceil(L*(1+R)), at least 1.

    R is taken as the decimal it was written as, so that 100 at 0.1 gives 90..110 (in floats 100 * (1 + 0.1)
    is 110.00000000000001, whose ceiling would be 111)."""
    exact = Fraction(repr(ratio))
    low = max(1, math.floor(length * (1 - exact)))
    return low, max(low, math.ceil(length * (1 + exact)))


def draw_lengths(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Each request's (input, output) length, drawn independently and uniformly from length_bounds.

    A generator of their own, seeded from --seed: the prompt and arrival stream stays the one of earlier
    runs, so at R=0 (every range a single value) prompts and arrivals are exactly those before the flag."""
    rng = random.Random(f"lengths-{args.seed}")
    inputs = length_bounds(args.input_len, args.random_range_ratio)
    outputs = length_bounds(args.output_len, args.random_range_ratio)
    return [(rng.randint(*inputs), rng.randint(*outputs)) for _ in range(args.num_prompts)]


def make_jobs(args: argparse.Namespace, rng: random.Random) -> list[Job]:
    return [Job(make_prompt(args, rng, input_len), input_len, output_len)
            for input_len, output_len in draw_lengths(args)]  # fmt: skip


def make_prompt(args: argparse.Namespace, rng: random.Random, input_len: int) -> Any:
    if args.prompt_type == "ids":
        return [rng.randrange(args.min_token_id, args.vocab_size) for _ in range(input_len)]
    return " ".join(rng.choice(WORDS) for _ in range(input_len))  # about one token per word


def request_body(args: argparse.Namespace, prompt: Any, output_len: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:  # only then: a server that refuses unknown fields (transformers serve) is served too
        body.update(ignore_eos=True, min_tokens=output_len)
    body.update(args.extra_body)
    if args.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, job: Job) -> Outcome:
    path, body = request_body(args, job.prompt, job.output_len)
    out = Outcome()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):  # the request failed after its stream started
                    out.error = f"stream error: {str(chunk['error'].get('message'))[:200]}"
                    return out
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    out.output_tokens = chunk["usage"].get("completion_tokens", 0)
                # A chunk that carries a choice carries a token; its text can be empty (a partial UTF-8
                # character held back, or a server started with --skip-tokenizer-init).
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.e2e = time.perf_counter() - start
    out.output_tokens = out.output_tokens or chunks
    out.ok = chunks > 0
    out.error = "" if out.ok else "no tokens streamed"
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 10_000)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        if args.model is None:
            args.model = await served_model(client)
        rng = random.Random(args.seed)
        jobs = make_jobs(args, rng)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(job: Job) -> Outcome:
            if gate is None:
                return await one_request(client, args, job)
            async with gate:
                return await one_request(client, args, job)

        tasks = []
        started_at = time.time()  # epoch: matches the server's per-request stats to this run
        started = time.perf_counter()
        for job in jobs:
            tasks.append(asyncio.create_task(limited(job)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(args, jobs, outcomes, duration, started_at)


class NotServing(RuntimeError):
    """The server cannot be benchmarked (not reachable, not ready, no model)."""


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model of /v1/models (NotServing when the server does not answer it)."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise NotServing(f"cannot reach {client.base_url}: {exc!r}") from exc
    if response.status_code != 200:
        raise NotServing(f"{client.base_url}/v1/models answered {response.status_code}: {response.text[:200]}")
    return response.json()["data"][0]["id"]


def verdict(result: dict[str, Any], allow_failures: bool) -> str | None:
    """Why the run is not a valid benchmark (None when it is)."""
    failed, total = result["failed"], result["completed"] + result["failed"]
    if result["completed"] == 0:
        return f"no request completed ({failed} failed: {result['errors']})"
    if failed and not allow_failures:
        return (f"{failed} of {total} requests failed ({result['errors']}); "
                "pass --allow-failures to report the others anyway")
    return None


def request_detail(job: Job, out: Outcome) -> dict[str, Any]:
    """One request's lengths, drawn and as the server reported them, and its latencies."""
    return {"input_len": job.input_len, "output_len": job.output_len, "ok": out.ok,
            "prompt_tokens": out.prompt_tokens, "output_tokens": out.output_tokens,
            "ttft_ms": out.ttft * 1e3, "e2e_ms": out.e2e * 1e3}  # fmt: skip


def summarize(
    args: argparse.Namespace, jobs: list[Job], outcomes: list[Outcome], duration: float, started_at: float = 0.0
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    output_tokens = sum(o.output_tokens for o in ok)
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    return {
        "base_url": args.base_url, "model": args.model, "endpoint": args.endpoint,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration, "started_at": started_at,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "total_output_tokens": output_tokens, "total_prompt_tokens": prompt_tokens,
        "mean_input_len": prompt_tokens / len(ok) if ok else None,
        "mean_output_len": output_tokens / len(ok) if ok else None,
        "ttft_ms": stats_ms([o.ttft for o in ok]),
        "tpot_ms": stats_ms(tpot),
        "itl_ms": stats_ms([gap for o in ok for gap in o.itl]),
        "e2e_ms": stats_ms([o.e2e for o in ok]),
        "requests": [request_detail(job, out) for job, out in zip(jobs, outcomes, strict=True)],
    }  # fmt: skip


def range_ratio(text: str) -> float:
    """argparse type of --random-range-ratio: a number R with 0 <= R < 1 (NaN fails the comparison)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must satisfy 0 <= R < 1, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=positive_int, default=512)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument(
        "--random-range-ratio", type=range_ratio, default=0.0, metavar="R",
        help="draw each input/output length uniformly in [L*(1-R), L*(1+R)], 0 <= R < 1 (0: fixed); varied "
        "lengths desynchronise arrivals under --max-concurrency as real traffic does, so prefills do not "
        "all share steps",
    )  # fmt: skip
    parser.add_argument("--prompt-type", choices=["ids", "text"], default="ids")
    parser.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    parser.add_argument("--min-token-id", type=int, default=100, help="and from this up (skips special ids)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--allow-failures", action="store_true",
                        help="exit 0 even when some requests failed (not when none completed)")
    parser.add_argument("--extra-body", type=json.loads, default={},
                        help="a JSON object merged into every request body (e.g. a response_format; a grammar "
                        "needs --no-ignore-eos)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except NotServing as exc:
        print(f"bench_serving: the server is not serving: {exc}", file=sys.stderr)
        return 1
    # The summary only: the per-request detail (one entry per prompt) goes to --json.
    summary = {key: value for key, value in result.items() if key != "requests"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    problem = verdict(result, args.allow_failures)
    if problem is not None:
        print(f"bench_serving: not a valid benchmark: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
