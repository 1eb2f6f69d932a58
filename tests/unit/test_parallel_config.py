"""Validation of every parallelism parameter on the seed page (app/config/rules.py parallelism_problems,
app/config/support.py): the combinations this build runs load; every other one stops with a message
that names the flags."""

from __future__ import annotations

import pytest

from tests.unit.test_config import error_of, load

ADDR = ["--dist-init-addr", "10.0.0.1:29500"]


@pytest.mark.parametrize("argv", [
    ["--tp", "2"], ["--attn-tp-size", "4"], ["--tensor-parallel-size", "2", "--dense-tp-size", "2"],
    ["--data-parallel-size", "2"], ["--tp", "2", "--data-parallel-size", "2", "--world-size", "4"],
    ["--tp", "4", "--nnodes", "2", "--node-rank", "1", *ADDR],
    ["--tp", "4", "--nnodes", "2", "--nprocs-per-node", "2", *ADDR], ["--nprocs-per-node", "1"],
    ["--base-gpu-id", "2", "--gpu-id-step", "2"], ["--data-parallel-size", "2", "--load-balance-method", "round_robin"],
    ["--ep-size", "1"], ["--dist-init-addr", "node0.svc:29500"],
])  # fmt: skip
def test_parallel_layouts_this_build_runs_load(argv: list[str]) -> None:
    load(["m", *argv])


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "2", "--dense-tp-size", "4"], "--dense-tp-size 4 differs from --tensor-parallel-size 2"),
    (["--tp", "2", "--world-size", "3"], "--world-size 3 must equal --tensor-parallel-size x --data-parallel-size = 2"),
    (["--nnodes", "2", "--node-rank", "2", "--tp", "2", *ADDR], "--node-rank 2 must be below --nnodes 2"),
    (["--tp", "3", "--nnodes", "2", *ADDR], "3 worker processes (TP x DP) cannot be spread evenly over --nnodes 2"),
    (["--tp", "4", "--nnodes", "2", "--nprocs-per-node", "4", *ADDR], "--nprocs-per-node 4 must equal"),
    (["--tp", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr HOST:PORT"),
    (["--data-parallel-size", "2", "--nnodes", "2", *ADDR], "--data-parallel-size > 1 across several nodes"),
    (["--dist-init-addr", "10.0.0.1"], "must be HOST:PORT"),
    (["--dist-init-addr", "h:99999"], "must be HOST:PORT"),
    (["--data-parallel-size", "2", "--kv-events-config",
      '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:65535"}'], "plus data-parallel rank 1 is past port 65535"),
    (["--moe-tp-size", "2"], "expert parallelism"), (["--ep-size", "2"], "expert parallelism"),
    (["--enable-expert-parallel"], "expert parallelism"),
    (["--load-balance-method", "minimum_cache_usage"], "--load-balance-method: Input should be"),
])  # fmt: skip
def test_parallel_layouts_it_does_not_run_are_refused(argv: list[str], message: str) -> None:
    assert message in error_of(["m", *argv])
