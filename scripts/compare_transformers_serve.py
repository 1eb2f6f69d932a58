#!/usr/bin/env python3
"""This appliance against `transformers serve --continuous-batching` on the same model, same load.

Installs the peer (transformers with its serving extras, pinned below) in its own virtual environment
outside the repository when it is not there yet, starts both servers on the same model directory in
bf16, and runs the same load (app/bench/serving.py: /v1/completions, the same text prompts, a fixed
number of greedy output tokens) at each concurrency against each server in turn, alternating which goes
first each round, so that both meet the same contention from whatever else runs on the host.
Reports output tokens/s, TTFT p50 and the RSS of each server (the sum over its process tree, the
highest seen while the load ran), the ratios, and writes a JSON file and a Markdown table.

  python scripts/compare_transformers_serve.py --json compare.json
  python scripts/compare_transformers_serve.py --streams 1 8 --rounds 1 -- --max-num-seqs 32

Arguments after `--` go to `tokenspeed serve` (after the default recipe, so they win).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from app.bench import serving
from app.net import free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path("~/.cache/tokenspeed/models/smollm2-135m-instruct").expanduser()
DEFAULT_PEER_VENV = Path("~/.cache/tokenspeed/peer-venv").expanduser()
RECIPE = "configs/recipes/smollm2-135m-instruct.yaml"
# The peer, pinned: the torch this repository pins, and the transformers it pins, with `serve`'s extras.
PEER_PACKAGES = ("torch==2.13.0", "transformers[serving]==5.24.0")


@dataclass
class Server:
    """One server's process tree: started in its own session, its RSS sampled while a load runs."""

    name: str
    cmd: list[str]
    port: int
    log_path: Path
    ready_path: str = "/v1/models"  # answers 200 once requests are served
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 (kept open for the child's lifetime)
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env={**os.environ, **self.env}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}{self.ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout:.0f}s; see {self.log_path}")

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory of the server and each of its descendants, by "pid name" (the appliance's
        children in start order: the resource tracker, http, tokenizer, scheduler, worker)."""
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out = {}
        for proc in procs:
            try:
                out[f"{proc.pid} {proc.name()}"] = proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its descendants, summed."""
        return sum(self.rss_by_process().values())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class RssSampler:
    """The highest process-tree RSS of a server while a load runs (sampled every `period` seconds)."""

    def __init__(self, server: Server, period: float = 0.25) -> None:
        self.server, self.period, self.peak = server, period, 0
        self.peak_by_process: dict[str, int] = {}  # each process's own highest RSS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def _sample(self) -> None:
        by_process = self.server.rss_by_process()
        self.peak = max(self.peak, sum(by_process.values()))
        for name, rss in by_process.items():
            self.peak_by_process[name] = max(self.peak_by_process.get(name, 0), rss)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def ensure_peer(venv: Path) -> Path:
    """The peer's `transformers` command, installing it into `venv` first if it is not there."""
    exe = venv / "bin" / "transformers"
    if exe.exists():
        return exe
    print(f"installing the peer ({', '.join(PEER_PACKAGES)}) into {venv} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True)
    return exe


def appliance(model: Path, port: int, log_dir: Path, extra: list[str]) -> Server:
    cmd = [sys.executable, "-m", "app.cli", "serve", "--config", RECIPE, "--model", str(model),
           "--served-model-name", "model", "--port", str(port), "--host", "127.0.0.1", *extra]
    return Server("tokenspeed", cmd, port, log_dir / "tokenspeed.log", ready_path="/readiness")


def peer(exe: Path, model: Path, port: int, log_dir: Path, threads: int | None) -> Server:
    # The paged cache sized as the default recipe's pool (8192 tokens in blocks of 16, 2048 tokens a step):
    # left to itself, continuous batching took 13.8 GB of host memory for its cache on a 24 GB machine.
    cmd = [str(exe), "serve", str(model), "--continuous-batching", "--dtype", "bfloat16", "--device", "cpu",
           "--cb-block-size", "16", "--cb-num-blocks", "512", "--cb-max-batch-tokens", "2048",
           "--host", "127.0.0.1", "--port", str(port)]
    env = {"HF_HUB_OFFLINE": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return Server("transformers", cmd, port, log_dir / "transformers.log", env=env)


def load_args(server: Server, model: str, streams: int, args: argparse.Namespace) -> argparse.Namespace:
    """The same load for either server: completions with the same text prompts and exactly output_len
    greedy tokens each. This appliance takes ignore_eos and min_tokens; transformers serve refuses
    fields it does not know and reads generation settings from a generation_config JSON string."""
    argv = ["--base-url", server.base_url, "--model", model, "--endpoint", "completions",
            "--prompt-type", "text", "--num-prompts", str(max(args.min_prompts, streams * args.prompts_per_stream)),
            "--max-concurrency", str(streams), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--seed", str(args.seed + streams)]
    if server.name == "transformers":
        config = {"max_new_tokens": args.output_len, "min_new_tokens": args.output_len, "do_sample": False}
        argv += ["--no-ignore-eos", "--extra-body", json.dumps({"generation_config": json.dumps(config)})]
    return serving.parse_args(argv)


def measure(server: Server, model: str, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    with RssSampler(server) as rss:
        result = asyncio.run(serving.run(load_args(server, model, streams, args)))
    problem = serving.verdict(result, allow_failures=False)
    if problem is not None:
        raise RuntimeError(f"{server.name} at {streams} streams: {problem}")
    return {"output_tok_s": result["output_token_throughput"], "ttft_p50_ms": result["ttft_ms"]["p50"],
            "tpot_p50_ms": (result["tpot_ms"] or {}).get("p50"), "mean_output_len": result["mean_output_len"],
            "mean_input_len": result["mean_input_len"], "rss_peak_bytes": rss.peak,
            "rss_peak_by_process": rss.peak_by_process,
            "duration_s": result["duration_s"]}


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| streams | tokenspeed tok/s | transformers tok/s | ratio | tokenspeed TTFT p50 ms | "
             "transformers TTFT p50 ms | tokenspeed RSS MiB | transformers RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        t, p = row["tokenspeed"], row["transformers"]
        lines.append(f"| {row['streams']} | {t['output_tok_s']:.1f} | {p['output_tok_s']:.1f} | "
                     f"{row['ratio']:.2f} | {t['ttft_p50_ms']:.0f} | {p['ttft_p50_ms']:.0f} | "
                     f"{t['rss_peak_bytes'] / 2**20:.0f} | {p['rss_peak_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (about one token each)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-per-stream", type=int, default=2)
    parser.add_argument("--min-prompts", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs every load on both servers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("compare-logs"))
    parser.add_argument("--json", type=Path, default=Path("compare_transformers_serve.json"))
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--peer-threads", type=int, default=None,
                        help="OMP_NUM_THREADS for the peer (default: torch's, every core); on a host loaded by "
                        "other work, its spinning threads can make it many times slower than with one")
    return parser.parse_args(argv), extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model = args.model_dir.expanduser()
    servers = [appliance(model, free_port(), args.log_dir, extra),
               peer(ensure_peer(args.peer_venv), model, free_port(), args.log_dir, args.peer_threads)]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for server in servers:  # one at a time: start-up is the heaviest part of either
            server.start()
            server.wait_ready(args.ready_timeout)
        names = {servers[0].name: "model", servers[1].name: str(model)}
        # Every load has prompts of its own (a seed per round and concurrency): a prompt seen before would
        # be a prefix-cache hit, and its TTFT that of one token.
        for server in servers:  # warm both (first-request compilation, allocator growth)
            measure(server, names[server.name], 1, argparse.Namespace(**{**vars(args), "min_prompts": 2,
                                                                          "prompts_per_stream": 2}))
        for round_no in range(args.rounds):
            round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * (round_no + 1)})
            for streams in args.streams:
                order = servers if (round_no + streams) % 2 == 0 else servers[::-1]
                for server in order:
                    run = measure(server, names[server.name], streams, round_args)
                    runs.setdefault((server.name, streams), []).append(run)
                    print(f"round {round_no} {server.name:12s} {streams:3d} streams: "
                          f"{run['output_tok_s']:7.1f} tok/s, TTFT p50 {run['ttft_p50_ms']:7.1f} ms, "
                          f"RSS {run['rss_peak_bytes'] / 2**20:6.0f} MiB (" + ", ".join(
                              f"{name.split()[0]}: {rss / 2**20:.0f}" for name, rss in run["rss_peak_by_process"].items())
                          + ")", file=sys.stderr, flush=True)
    finally:
        for server in servers:
            server.stop()
    rows = []
    for streams in args.streams:
        row: dict[str, Any] = {"streams": streams}
        for server in servers:
            got = runs[(server.name, streams)]
            row[server.name] = {key: median_of(got, key) for key in
                                ("output_tok_s", "ttft_p50_ms", "rss_peak_bytes", "mean_output_len")}
            row[server.name]["runs"] = got
        row["ratio"] = row["tokenspeed"]["output_tok_s"] / row["transformers"]["output_tok_s"]
        rows.append(row)
    report = {"model": str(model), "input_len": args.input_len, "output_len": args.output_len,
              "rounds": args.rounds, "appliance_args": extra, "peer_threads": args.peer_threads, "peer_packages": list(PEER_PACKAGES),
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "rows": rows}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
