"""Start the whole appliance (`tokenspeed serve`, all processes) for a test, and stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from app.net import free_port

REPO = Path(__file__).resolve().parents[2]


class Appliance:
    """One `tokenspeed serve` process tree on a free port; logs go to a file for assertions."""

    def __init__(self, model: str | Path, *flags: str, env: dict[str, str] | None = None, log_dir: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"appliance-{self.port}.log"
        cmd = [sys.executable, "-m", "app.cli", "serve", str(model), "--port", str(self.port), "--device", "cpu"]
        cmd += ["--log-level", "info", *flags]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.children: list[psutil.Process] = []
        self.unready: list[dict] = []  # the 503 bodies /readiness gave while starting

    def wait_ready(self, timeout: float = 180.0) -> Appliance:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"appliance exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                r = httpx.get(f"{self.base_url}/readiness", timeout=2)
                if r.status_code == 200:
                    self.children = psutil.Process(self.proc.pid).children(recursive=True)
                    return self
                self.unready.append(r.json())
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        self.kill()
        raise TimeoutError(f"appliance not ready in {timeout}s:\n{self.logs()[-4000:]}")

    def loads(self, headers: dict[str, str] | None = None) -> list[dict]:
        """/get_loads: one entry per data-parallel replica."""
        r = httpx.get(f"{self.base_url}/get_loads", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["loads"]

    def wait_idle(self, timeout: float = 15.0, headers: dict[str, str] | None = None) -> dict:
        """Replica 0's loads once no replica runs or queues a request and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.loads(headers)
            if all((e["num_running"], e["num_waiting"], e["num_used_blocks"]) == (0, 0, 0) for e in now):
                return now[0]
            assert time.monotonic() < deadline, f"the engine did not go idle: {now}"
            time.sleep(0.1)

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def child_pid(self, name: str) -> int:
        """A child's pid by its role (http, tokenizer, scheduler, worker0), from the start-up log."""
        match = re.search(rf"started {name} \(pid (\d+)\)", self.logs())
        if match is None:
            raise LookupError(name)
        return int(match.group(1))

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful drain); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def leftover_processes(self, grace: float = 5.0) -> list[psutil.Process]:
        """Children still alive after the supervisor exited, allowing them grace seconds to go."""
        deadline = time.monotonic() + grace
        while (alive := self._alive_children()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive

    def _alive_children(self) -> list[psutil.Process]:
        alive = []
        for proc in self.children:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                continue
        return alive

    def __enter__(self) -> Appliance:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
        for proc in self.leftover_processes():
            proc.kill()
