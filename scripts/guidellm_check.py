"""Run guidellm (the vLLM project's load-testing client) against the appliance, streaming and not.

guidellm is a real client of the ecosystem: it sends stream_options.continuous_usage_stats and leaves
`model` out unless told, which this server must accept. The script starts the appliance on the embedded
model (or uses --url), runs a short synchronous benchmark per mode on chat and completions, and fails
if any request failed (about 6 minutes on 2 CPU cores, mostly guidellm's own start-up).

guidellm is not a dependency of the project (it pulls its own torch); install it apart:
    python3 -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm==0.8.1
    .venv/bin/python scripts/guidellm_check.py --guidellm /tmp/guidellm-venv/bin/guidellm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_MODEL_DIR = Path.home() / ".cache/tokenspeed/models/smollm2-135m-instruct"


def run_guidellm(guidellm: str, url: str, tokenizer: Path, *, stream: bool, route: str, requests: int,
                 out: Path) -> dict[str, Any]:
    cmd = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={url},stream={str(stream).lower()},request_format={route}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={requests}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the tokenizer is a local directory
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def request_counts(report: dict[str, Any]) -> dict[str, int]:
    """successful / errored / incomplete request counts over the report's benchmarks."""
    totals = {"successful": 0, "errored": 0, "incomplete": 0}
    for bench in report.get("benchmarks", []):
        stats = bench.get("scheduler_state") or {}
        for key in totals:
            totals[key] += int(stats.get(f"{key}_requests", 0) or 0)
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    parser.add_argument("--url", help="a running appliance (default: start one on the embedded model)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="the served model's directory (its tokenizer shapes guidellm's prompts)")
    parser.add_argument("--requests", type=int, default=4, help="requests per run")
    args = parser.parse_args()

    from tests.support.appliance import Appliance

    workdir = Path(tempfile.mkdtemp(prefix="guidellm-"))
    starting = None if args.url else Appliance(
        args.model_dir, "--config", "configs/recipes/smollm2-135m-instruct.yaml", log_dir=workdir)
    failed = False
    with starting if starting is not None else nullcontext():
        url = args.url or starting.base_url
        for route in ("/v1/chat/completions", "/v1/completions"):
            for stream in (True, False):
                report = run_guidellm(args.guidellm, url, args.model_dir, stream=stream, route=route,
                                      requests=args.requests, out=workdir / f"report-{stream}-{route[4:8]}.json")
                counts = request_counts(report)
                # guidellm may stop at the request limit with the last request still in flight (it then
                # counts it nowhere); what matters is that every answered request succeeded.
                ok = counts["successful"] > 0 and not counts["errored"] and not counts["incomplete"]
                failed |= not ok
                print(f"{route} stream={stream}: {counts} {'ok' if ok else 'FAILED'}")
    print(f"reports and logs: {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
