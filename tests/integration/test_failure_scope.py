"""Issue 28 end to end: one request's problem fails that request alone, weight updates read only below
the allowed roots, and a start-up failure is one line and a quick non-zero exit.

One appliance (tiny llama, `--sampling-backend greedy`, bound to 0.0.0.0 with an admin key) serves the
module. The worker-level cases (every refused parameter, NaN rows, prefix-cache hits, preemption) are
in tests/unit/test_failure_isolation.py; the closed control routes in test_reliability_components.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from tests.support.appliance import REPO, Appliance, free_port

ADMIN_KEY = "sk-failure-scope-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def app(tiny_model_dirs, log_dir):
    flags = ("--sampling-backend", "greedy", "--host", "0.0.0.0", "--admin-api-key", ADMIN_KEY,
             "--max-num-seqs", "12", "--block-size", "4")
    with Appliance(tiny_model_dirs["llama"], *flags, log_dir=log_dir) as appliance:
        yield appliance


def generate(app: Appliance, prompt: list[int], n: int = 8, **sampling: Any) -> httpx.Response:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True,
                                                     **sampling}}
    return httpx.post(f"{app.base_url}/generate", json=body, timeout=60)


def concurrently(*calls: Any) -> list[Any]:
    results: list[Any] = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, calls[i]())) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def test_a_request_the_sampler_cannot_serve_is_a_400_and_its_neighbours_finish(app: Appliance) -> None:
    """The issue's case: eight greedy requests running and one with temperature 0.9 on the greedy backend."""
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]
    alone = [generate(app, prompt, n=12).json()["output_ids"] for prompt in prompts]
    calls = [lambda p=prompt: generate(app, p, n=12) for prompt in prompts]
    *good, bad = concurrently(*calls, lambda: generate(app, PROMPT, temperature=0.9))
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"], bad.text
    assert [r.status_code for r in good] == [200] * 8
    assert [r.json()["output_ids"] for r in good] == alone
    # n: a request's choices are refused together; another request's choices are served.
    completion = {"model": app_model(app), "prompt": "hello", "max_tokens": 3}
    bad_n, good_n = concurrently(
        lambda: httpx.post(f"{app.base_url}/v1/completions", json={**completion, "n": 3, "temperature": 0.5},
                           timeout=60),
        lambda: httpx.post(f"{app.base_url}/v1/completions", json={**completion, "n": 2, "temperature": 0},
                           timeout=60))
    assert bad_n.status_code == 400 and "sampling backend 'greedy'" in bad_n.json()["error"]["message"]
    assert good_n.status_code == 200 and len({c["text"] for c in good_n.json()["choices"]}) == 1
    assert app.wait_idle(headers=ADMIN)["num_used_blocks"] == 0


def app_model(app: Appliance) -> str:
    return httpx.get(f"{app.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_weight_updates_read_only_below_the_allowed_roots(app: Appliance, tiny_model_dirs, tmp_path) -> None:
    """The model's own directory reloads, during a request too; elsewhere is refused the same way whether it
    exists or not."""
    post = lambda body: httpx.post(f"{app.base_url}/update_weights_from_disk", json=body, headers=ADMIN,  # noqa: E731
                                   timeout=120)
    shutil.copytree(tiny_model_dirs["llama"], tmp_path / "copy")
    messages = set()
    for path in ("/etc", "/nonexistent/model", str(tmp_path / "copy"), f"{tiny_model_dirs['llama']}/../../.."):
        r = post({"model_path": path})
        assert r.status_code == 400 and not r.json()["success"], r.text
        messages.add(r.json()["message"].replace(repr(path), "PATH"))
    assert len(messages) == 1 and "is not below an allowed root" in messages.pop()
    assert httpx.post(f"{app.base_url}/update_weights_from_disk", json={"model_path": "/etc"}, timeout=10
                      ).status_code == 401  # the admin key guards it
    expected = generate(app, PROMPT, n=24).json()["output_ids"]
    running, update = concurrently(lambda: generate(app, PROMPT, n=24),
                                   lambda: (time.sleep(0.2), post({"model_path": str(tiny_model_dirs["llama"])}))[1])
    assert update.status_code == 200 and update.json()["success"], update.text
    assert running.status_code == 200 and running.json()["output_ids"] == expected  # the same weights again


def test_a_start_up_failure_is_one_line_and_a_quick_non_zero_exit(tiny_model_dirs, tmp_path) -> None:
    """A model directory with a broken config.json: every process that meets it says so in one line, and
    the supervisor stops the rest at once (no traceback, no 5 s wait for a doomed scheduler)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dirs["llama"], broken)
    (broken / "config.json").write_text("{not json")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(broken), "--device", "cpu",
                             "--port", str(free_port())], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, failed_at = [], None
    try:
        for line in proc.stdout:  # until the supervisor exits and closes it
            lines.append(line)
            if failed_at is None and " failed: " in line:
                failed_at = time.monotonic()
        proc.wait(30)
    finally:
        proc.kill()
    after_cause = time.monotonic() - (failed_at or 0)
    out = "".join(lines)
    assert proc.returncode == 1, out
    assert "Traceback" not in out and "did not stop in" not in out, out
    failures = [line for line in lines if " failed: " in line]
    assert failures and all("--log-level debug shows the traceback" in line for line in failures), out
    assert any("config.json" in line for line in failures), out
    assert after_cause < 5, f"exited {after_cause:.1f} s after the failure:\n{out}"
