"""scripts/compare_transformers_serve.py: the same load for both servers, in the fields each accepts."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

from app.bench import serving

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("compare_ts", ROOT / "scripts/compare_transformers_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_ts"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_both_servers_get_the_same_prompts_and_lengths(tmp_path: Path) -> None:
    cmp = load_script()
    args, extra = cmp.parse_args(["--output-len", "64", "--", "--max-num-seqs", "8"])
    assert extra == ["--max-num-seqs", "8"]
    ours = cmp.appliance(Path("/m"), 1, tmp_path, extra)
    peer = cmp.peer(Path("/venv/bin/transformers"), Path("/m"), 2, tmp_path, threads=1)
    assert peer.env["OMP_NUM_THREADS"] == "1" and "--continuous-batching" in peer.cmd
    bodies = {}
    for server in (ours, peer):
        load = cmp.load_args(server, "m", 8, args)
        rng = serving.random.Random(load.seed)
        jobs = serving.make_jobs(load, rng)
        bodies[server.name] = [serving.request_body(load, job.prompt, job.output_len) for job in jobs]
    assert len(bodies["tokenspeed"]) == len(bodies["transformers"]) == 16
    for (path_a, a), (path_b, b) in zip(bodies["tokenspeed"], bodies["transformers"], strict=True):
        assert path_a == path_b == "/v1/completions"
        assert a["prompt"] == b["prompt"] and a["max_tokens"] == b["max_tokens"] == 64
        assert (a["ignore_eos"], a["min_tokens"]) == (True, 64)
        # transformers serve refuses fields it does not know (422): its lengths go in generation_config
        assert "ignore_eos" not in b and "min_tokens" not in b
        assert json.loads(b["generation_config"])["min_new_tokens"] == 64


def test_rss_is_summed_over_the_process_tree(tmp_path: Path) -> None:
    cmp = load_script()
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)")
    server = cmp.Server("tree", [sys.executable, "-c", code], 0, tmp_path / "tree.log")
    server.start()
    try:
        deadline = time.monotonic() + 20
        while len(cmp.psutil.Process(server.proc.pid).children(recursive=True)) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        own = cmp.psutil.Process(server.proc.pid).memory_info().rss
        assert server.rss_bytes() > own
    finally:
        server.stop()
    assert server.proc.poll() is not None


def test_each_concurrency_gets_prompts_of_its_own(tmp_path: Path) -> None:
    """A prompt sent before would hit the appliance's prefix cache: its TTFT would be one token's."""
    cmp = load_script()
    args, _ = cmp.parse_args([])
    ours = cmp.appliance(Path("/m"), 1, tmp_path, [])
    prompts = {}
    for streams in (1, 8):
        load = cmp.load_args(ours, "m", streams, args)
        jobs = serving.make_jobs(load, serving.random.Random(load.seed))
        prompts[streams] = {job.prompt for job in jobs}
    assert not prompts[1] & prompts[8]
