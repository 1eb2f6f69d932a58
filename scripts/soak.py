"""A bounded soak: thousands of mixed requests against one appliance, with the RSS of every process
sampled throughout. It passes when each process's RSS at the end is within the margin of its RSS after
the warm-up, the KV pool is back to no block in use and nothing is left in flight.

    python scripts/soak.py                      # a tiny random Llama, 10000 requests
    python scripts/soak.py --model DIR --requests 10000 --json soak.json -- --max-num-seqs 64

Traffic (by request index): streaming chat, whole completions, native /generate batches, streams the
client leaves after two chunks, and invalid requests (400). Exit 0 on pass, 1 on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.appliance import Appliance  # noqa: E402

MIB = 1024 * 1024


@dataclass
class Tally:
    done: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: str) -> None:
        self.done += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], leave_after: int | None) -> str:
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"http {r.status_code}"
        chunks = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return "stream done"
            if line.startswith("data: "):
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return "stream left"
    return "stream cut"


async def one_request(client: httpx.AsyncClient, model: str, i: int) -> str:
    kind = i % 10
    prompt = f"soak request {i}: tell me about item {i % 97}"
    if kind < 4:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                "stream": True, "temperature": 0.8, "seed": i}
        return await _stream(client, "/v1/chat/completions", body, None)
    if kind < 7:
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                       "n": 1 + i % 2, "logprobs": i % 3})
        return f"http {r.status_code}"
    if kind == 7:
        r = await client.post("/generate", json={"text": [prompt, prompt + "!"],
                                                 "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
        return f"http {r.status_code}"
    if kind == 8:
        body = {"model": model, "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
        return await _stream(client, "/v1/completions", body, leave_after=2)
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 9})
    return f"http {r.status_code}"


async def drive(base_url: str, model: str, total: int, concurrency: int, tally: Tally, deadline: float) -> None:
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        async def worker() -> None:
            for i in counter:
                if time.monotonic() > deadline:
                    return
                try:
                    tally.add(await one_request(client, model, i))
                except httpx.HTTPError as exc:
                    tally.add(f"transport {type(exc).__name__}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def processes(app: Appliance) -> dict[str, psutil.Process]:
    """The supervisor and every child it started (schedulers and workers per replica and TP rank)."""
    out = {"supervisor": psutil.Process(app.proc.pid)}
    for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", app.logs()):
        out[name] = psutil.Process(int(pid))
    return out


async def sample(procs: dict[str, psutil.Process], tally: Tally, samples: list[dict[str, Any]],
                 every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append({"t": time.monotonic(), "done": tally.done,
                        **{name: p.memory_info().rss for name, p in procs.items()}})
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def soak(app: Appliance, args: argparse.Namespace) -> tuple[Tally, list[dict[str, Any]], float]:
    model = httpx.get(f"{app.base_url}/v1/models").json()["data"][0]["id"]
    procs = processes(app)
    tally, samples, stop = Tally(), [], asyncio.Event()
    sampler = asyncio.create_task(sample(procs, tally, samples, args.sample_every, stop))
    started = time.monotonic()
    await drive(app.base_url, model, args.requests, args.concurrency, tally, started + args.max_seconds)
    elapsed = time.monotonic() - started
    await asyncio.sleep(1.0)  # let the last aborts land
    stop.set()
    await sampler
    return tally, samples, elapsed


def verdict(samples: list[dict[str, Any]], warmup: int, margin_mib: float, margin_pct: float) -> list[dict]:
    """Per process: RSS after the warm-up (median of the first quarter of later samples) against the end
    (median of the last quarter); it passes within max(margin_mib, margin_pct of the baseline)."""
    after = [s for s in samples if s["done"] >= warmup]
    if len(after) < 8:
        raise SystemExit(f"only {len(after)} samples after the warm-up: run longer or sample more often")
    quarter = max(2, len(after) // 4)
    rows = []
    for name in (k for k in samples[0] if k not in ("t", "done")):
        base = statistics.median(s[name] for s in after[:quarter])
        end = statistics.median(s[name] for s in after[-quarter:])
        peak = max(s[name] for s in after)
        allowed = max(margin_mib * MIB, margin_pct / 100 * base)
        rows.append({"process": name, "baseline_mib": base / MIB, "end_mib": end / MIB, "peak_mib": peak / MIB,
                     "growth_mib": (end - base) / MIB, "allowed_mib": allowed / MIB, "ok": end - base <= allowed,
                     "late_trend_mib_per_1k": _slope(after[len(after) // 2:], name) * 1000 / MIB})
    return rows


def _slope(samples: list[dict[str, Any]], name: str) -> float:
    """Least-squares bytes per request (informative: a plateau shows ~0, a leak a steady slope)."""
    xs, ys = [s["done"] for s in samples], [s[name] for s in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def table(rows: list[dict]) -> str:
    lines = ["| process | RSS after warm-up (MiB) | RSS at the end (MiB) | peak (MiB) | growth (MiB) | "
             "allowed (MiB) | second-half trend (MiB / 1k requests) | stable |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['process']} | {r['baseline_mib']:.1f} | {r['end_mib']:.1f} | {r['peak_mib']:.1f} | "
                     f"{r['growth_mib']:+.1f} | {r['allowed_mib']:.1f} | {r['late_trend_mib_per_1k']:+.2f} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model dir (default: a tiny random Llama made now)")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=500, help="requests before the RSS baseline")
    parser.add_argument("--margin-mib", type=float, default=24.0)
    parser.add_argument("--margin-pct", type=float, default=10.0)
    parser.add_argument("--sample-every", type=float, default=1.0, help="seconds between RSS samples")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="stop sending after this long")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("serve_flags", nargs="*", help="extra `tokenspeed serve` flags (after --)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        model = args.model
        if model is None:
            from tests.support.model_factory import build_tiny_model

            model = build_tiny_model("llama", Path(tmp) / "llama", seed=1)
        app = Appliance(model, *args.serve_flags, log_dir=Path(tmp)).wait_ready()
        try:
            try:
                tally, samples, elapsed = asyncio.run(soak(app, args))
            except Exception:  # the appliance's own account of it, before its log dir goes
                print(app.logs()[-6000:], file=sys.stderr)
                raise
            loads = httpx.get(f"{app.base_url}/get_loads", timeout=10).json()["loads"][0]
            inflight = httpx.get(f"{app.base_url}/get_server_info", timeout=10).json()["num_inflight_requests"]
        finally:
            code = app.stop()
    rows = verdict(samples, args.warmup, args.margin_mib, args.margin_pct)
    clean = loads["num_used_blocks"] == 0 and loads["num_running"] == 0 and inflight == 0
    bad = {k: v for k, v in tally.outcomes.items() if k not in ("http 200", "http 400", "stream done", "stream left")}
    ok = all(r["ok"] for r in rows) and clean and not bad and code == 0
    result = {"requests": tally.done, "seconds": round(elapsed, 1), "requests_per_s": round(tally.done / elapsed, 1),
              "outcomes": tally.outcomes, "kv_blocks_in_use_after": loads["num_used_blocks"],
              "inflight_after": inflight, "exit_code": code, "processes": rows, "passed": ok,
              "margin": f"max({args.margin_mib:g} MiB, {args.margin_pct:g}% of the post-warm-up RSS)"}
    print(table(rows))
    print(f"\n{tally.done} requests in {elapsed:.0f} s ({result['requests_per_s']} req/s), outcomes "
          f"{tally.outcomes}; KV blocks in use after: {loads['num_used_blocks']}, in flight: {inflight}; "
          f"appliance exit code {code}: {'PASS' if ok else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
