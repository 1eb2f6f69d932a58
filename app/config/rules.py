"""Rules that tie several settings together (the per-field ranges live on the fields).

TP size versus attention heads needs the model's config, and whether its GPU exists needs the node, so
each worker checks those when it starts (app/worker/models/dense.py, app/worker/process.py).

The rules read the settings' values as a mapping (as support.unsupported does), not the Settings model:
Settings runs them while it validates, so this module must not import it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from app.config.errors import Problem
from app.config.kv_events import kv_events_config_problem


def cross_field_problems(values: Mapping[str, Any]) -> list[Problem]:
    s = SimpleNamespace(**values)  # the fields by name, as on Settings
    problems: list[Problem] = []
    if s.chunked_prefill_size == -1 and s.max_model_len is not None and s.max_prefill_tokens < s.max_model_len:
        problems.append(Problem(
            ("max_prefill_tokens", "max_model_len", "chunked_prefill_size"),
            f"--max-prefill-tokens {s.max_prefill_tokens} must be >= --max-model-len {s.max_model_len} when "
            "chunked prefill is off (--chunked-prefill-size -1): a whole prompt must fit in one prefill",
        ))
    if s.max_total_tokens is not None:
        if s.max_total_tokens < s.block_size:
            problems.append(Problem(
                ("max_total_tokens", "block_size"),
                f"--max-total-tokens {s.max_total_tokens} is smaller than one KV block (--block-size "
                f"{s.block_size})",
            ))
        if s.max_model_len is not None and s.max_total_tokens < s.max_model_len:
            problems.append(Problem(
                ("max_total_tokens", "max_model_len"),
                f"--max-total-tokens {s.max_total_tokens} must be >= --max-model-len {s.max_model_len}: "
                "a sequence of the maximum length must fit in the KV pool",
            ))
    return problems + parallelism_problems(values)


def parallelism_problems(values: Mapping[str, Any]) -> list[Problem]:
    """The parallelism combinations this build runs (app/topology.py): dp replicas of tp workers each,
    on one node or, with dp = 1, spread evenly over --nnodes nodes."""
    s = SimpleNamespace(**values)
    problems: list[Problem] = []
    tp, dp = s.tensor_parallel_size, s.data_parallel_size
    world = tp * dp
    if s.dense_tp_size is not None and s.dense_tp_size != tp:
        problems.append(Problem(
            ("dense_tp_size", "tensor_parallel_size"),
            f"--dense-tp-size {s.dense_tp_size} differs from --tensor-parallel-size {tp}: different attention and "
            "dense TP sizes need attention data parallelism, which is not built yet (leave it unset or equal)",
        ))
    if s.moe_tp_size is not None and s.moe_tp_size != tp:
        problems.append(Problem(
            ("moe_tp_size", "tensor_parallel_size"),
            f"--moe-tp-size {s.moe_tp_size} differs from --tensor-parallel-size {tp}: the experts are split over "
            "the TP ranks (leave it unset or equal); a different size needs expert parallelism, not built",
        ))
    if s.world_size is not None and s.world_size != world:
        problems.append(Problem(
            ("world_size", "tensor_parallel_size", "data_parallel_size"),
            f"--world-size {s.world_size} must equal --tensor-parallel-size x --data-parallel-size = {world}",
        ))
    if s.node_rank >= s.nnodes:
        problems.append(Problem(("node_rank", "nnodes"),
                                f"--node-rank {s.node_rank} must be below --nnodes {s.nnodes}"))
    if world % s.nnodes:
        problems.append(Problem(
            ("nnodes", "tensor_parallel_size"),
            f"{world} worker processes (TP x DP) cannot be spread evenly over --nnodes {s.nnodes}",
        ))
    elif s.nprocs_per_node is not None and s.nprocs_per_node != world // s.nnodes:
        problems.append(Problem(
            ("nprocs_per_node", "nnodes"),
            f"--nprocs-per-node {s.nprocs_per_node} must equal the {world} worker processes over --nnodes "
            f"{s.nnodes} = {world // s.nnodes}",
        ))
    if s.nnodes > 1:
        if dp > 1:
            problems.append(Problem(
                ("data_parallel_size", "nnodes"),
                "--data-parallel-size > 1 across several nodes is not built yet: run one appliance per node "
                "(each with its own data-parallel replicas) behind a load balancer",
            ))
        if s.dist_init_addr is None:
            problems.append(Problem(
                ("dist_init_addr", "nnodes"),
                "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)",
            ))
    if dp > 1 and s.kv_events_config is not None:  # each replica publishes on its own port (offset by dp_rank)
        problem = kv_events_config_problem(s.kv_events_config, dp)
        if problem is not None:
            problems.append(Problem(("kv_events_config", "data_parallel_size"), problem))
    if s.dist_init_addr is not None and not _host_port(s.dist_init_addr):
        problems.append(Problem(
            ("dist_init_addr",),
            f"--dist-init-addr {s.dist_init_addr!r} must be HOST:PORT (e.g. 10.0.0.1:29500)",
        ))
    return problems


def _host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
