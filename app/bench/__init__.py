"""The user benchmarks, run as `tokenspeed bench serving|offline|latency [flags]`.

serving: any OpenAI-compatible server over HTTP (TTFT, TPOT, ITL, throughput).
offline: the real Scheduler driving a ModelRunner in process (throughput of N queued requests).
latency: the ModelRunner alone at a fixed batch (prefill and per-step decode time, graph replay).
Each module also runs as `python -m app.bench.NAME`. Imported late: latency and offline pull in torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHMARKS = {
    "serving": "load an OpenAI-compatible server over HTTP: TTFT, TPOT, ITL, throughput",
    "offline": "in process: the scheduler and model runner on N queued requests (throughput)",
    "latency": "in process: the model runner at a fixed batch (prefill, decode step, graph replay)",
}


def usage() -> str:
    lines = ["usage: tokenspeed bench {serving,offline,latency} [flags] (NAME --help for its flags)", ""]
    lines += [f"  {name:<8} {what}" for name, what in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        what = f"unknown benchmark {argv[0]!r}" if argv else "a benchmark name is required"
        print(f"{usage()}\ntokenspeed bench: error: {what}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"app.bench.{argv[0]}")
    except ModuleNotFoundError as exc:
        if exc.name != "httpx":
            raise
        print(f"tokenspeed bench {argv[0]} needs httpx: pip install 'tokenspeed-appliance[bench]'", file=sys.stderr)
        return 2
    result = module.main(argv[1:])
    return result if isinstance(result, int) else 0
