#!/usr/bin/env python3
"""Start-up time of the appliance as a user meets it: process start to the first /readiness 200, and the
longest stretch of that start with no log line (issue 34's two figures), per scenario:

  cold     empty kernel caches (fresh TRITON_CACHE_DIR and FLASHINFER_WORKSPACE_BASE): a fresh machine
  warm     the same caches again: every later start
  warmup   fresh caches, `tokenspeed warmup` first (timed apart), then serve: the flashinfer backend

    python3 scripts/gpu/cold_start.py [--scenarios cold warm warmup] [--json OUT] [-- serve flags...]

The model is the Llama-3.1-8B shape with dummy bf16 weights and a word-level tokenizer
(scripts/gpu/wordlevel_tokenizer.py), the default attention backend, as in serve_and_bench.sh. Each
log line is stamped when it arrives; the table says which line ended the longest silence. On the H200:
scripts/gpu/run_h200.sh cold_start (with NO_WARM=1, so that no flashinfer build competes for the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ROOT / "configs" / "models" / "llama-3.1-8b"
MODEL = Path("/tmp/llama-3.1-8b-wordlevel")
PORT = 8011


class Logged:
    """A child whose output lines are kept with the monotonic time each arrived."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.started = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def longest_silence(self, until: float) -> tuple[float, str]:
        """The longest gap between two lines (the first counted from the start) before `until`, and
        the line that ended it."""
        best, ended, last = 0.0, "", 0.0
        for at, line in self.lines:
            if at > until:
                break
            if at - last > best:
                best, ended = at - last, line
            last = at
        return round(best, 1), ended

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.reader.join(5)
        self.log.close()
        return self.proc.returncode


def readiness(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return 0, {}


def serve(name: str, env: dict[str, str], flags: list[str], out: Path, limit: float) -> dict:
    cmd = [sys.executable, "-m", "app.cli", "serve", str(MODEL), "--load-format", "dummy", "--dtype", "bfloat16",
           "--device", "cuda", "--max-model-len", "4096", "--port", str(PORT), *flags]
    child = Logged(cmd, env, out / f"cold_start-{name}.log")
    phases_seen: list[str] = []
    ready_at = None
    while time.monotonic() - child.started < limit and child.proc.poll() is None:
        status, body = readiness(PORT)
        if status == 200:
            ready_at = time.monotonic() - child.started
            break
        if body.get("phase") and (not phases_seen or phases_seen[-1] != body["phase"]):
            phases_seen.append(body["phase"])
        time.sleep(0.1)
    until = ready_at if ready_at is not None else time.monotonic() - child.started
    silence, ended = child.longest_silence(until)
    summary = next((line for _, line in child.lines if "start-up phases:" in line), "")
    backend = next((line.split("attention backend ")[1].split(" ")[0].rstrip(";")
                    for _, line in child.lines if "attention backend " in line), "")
    code = child.stop()
    result = {"scenario": name, "ready_s": None if ready_at is None else round(ready_at, 1),
              "longest_silence_s": silence, "silence_ended_by": ended[-160:], "readiness_phases": phases_seen,
              "summary": summary.split("start-up phases: ")[-1], "attention_backend": backend, "exit_code": code}
    if ready_at is None:
        result["tail"] = [line for _, line in child.lines[-15:]]
    return result


def warmup(env: dict[str, str], flags: list[str], out: Path) -> dict:
    started = time.monotonic()
    cmd = [sys.executable, "-m", "app.cli", "warmup", str(MODEL), "--load-format", "dummy", "--dtype", "bfloat16",
           "--device", "cuda", "--max-model-len", "4096", *flags]
    with open(out / "cold_start-warmup-build.log", "w") as log:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return {"scenario": "warmup (build)", "seconds": round(time.monotonic() - started, 1), "exit_code": code}


def fresh_caches(root: Path, name: str) -> dict[str, str]:
    base = root / name
    (base / "triton").mkdir(parents=True)
    (base / "flashinfer").mkdir()
    return {"TRITON_CACHE_DIR": str(base / "triton"), "FLASHINFER_WORKSPACE_BASE": str(base / "flashinfer")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=["cold", "warm", "warmup"],
                        choices=["cold", "warm", "warmup"])
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "cold_start.json")
    parser.add_argument("--limit", type=float, default=240.0, help="seconds a start may take before it counts as failed")
    parser.add_argument("flags", nargs="*", help="extra serve flags (after --)")
    args = parser.parse_args()
    if not MODEL.is_dir():
        subprocess.check_call([sys.executable, "scripts/gpu/wordlevel_tokenizer.py", str(SHAPE), str(MODEL)], cwd=ROOT)
    out = args.json.parent
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cold-start-"))
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    results = []
    cold = fresh_caches(root, "cold")
    for scenario in args.scenarios:
        if scenario in ("cold", "warm"):  # warm reuses the cold start's caches
            results.append(serve(scenario, {**base_env, **cold}, args.flags, out, args.limit))
        else:
            caches = {**base_env, **fresh_caches(root, "warmup")}
            results.append(warmup(caches, args.flags, out))
            results.append(serve("after warmup", caches, args.flags, out, args.limit))
        print(json.dumps(results[-1]), flush=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{'scenario':<16} {'ready s':>8} {'silence s':>9}  backend     phases")
    for r in results:
        print(f"{r['scenario']:<16} {r.get('ready_s', r.get('seconds'))!s:>8} {r.get('longest_silence_s', '')!s:>9}  "
              f"{r.get('attention_backend', ''):<11} {r.get('summary', '')}")
    return 0 if all(r.get("exit_code") == 0 and r.get("ready_s", 0) is not None for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
