"""Tensor parallelism on two GPUs (NCCL; skipped with fewer): greedy output of a TP=2 group equals the
one-GPU run's, for each graph-capable backend, eager and with CUDA graphs (the graphs capture the
all-reduces: the one-shot kernel over peer memory for the small ones, app/worker/peer_all_reduce.py),
and with NCCL alone (--disable-custom-all-reduce); and a worker placed on a GPU that does not exist
stops with a message that says so."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.worker.model_runner import ModelRunner
from app.worker.process import resolve_device
from app.worker.tp_group import start_tp_group
from tests.gpu.test_backends_gpu import BACKENDS, run_requests, settings
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import prompts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
CUDA = torch.device("cuda", 0)
GROUP_TIMEOUT_S = 150


@pytest.fixture(autouse=True)
def free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _leader_main(fields: dict, model_dir: str, prompts: list[list[int]], queue: Any) -> None:
    """TP rank 0 in a process of its own: an NCCL group that CUDA graphs captured cannot be destroyed
    (app/worker/parallel.py), so each group lives and dies with its processes."""
    try:
        leader = start_tp_group(settings(Path(model_dir), **fields), CUDA, 2)
        outputs = run_requests(leader, prompts, 24)
        queue.put((leader.graphs is not None, (outputs, leader.tp.all_reduce_path)))
        leader.close()
    except Exception:
        queue.put((None, traceback.format_exc()))
    os._exit(0)


@two_gpus
@pytest.mark.parametrize(("eager", "nccl_only"), [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if getattr(b, "values", (b,))[0] != "torch"])
def test_tp2_greedy_equals_one_gpu(backend: str, eager: bool, nccl_only: bool, tmp_path: Path) -> None:
    # head_dim 64: flashinfer's smallest (the default tiny model's 16 is triton-only)
    model_dir = build_tiny_model("llama", tmp_path, seed=2, hidden_size=256, head_dim=64, intermediate_size=256)
    fields = {"dtype": "float32" if backend == "triton" else "bfloat16", "block_size": 4,
              "attention_backend": backend, "enforce_eager": eager, "gpu_memory_utilization": 0.3,
              "disable_custom_all_reduce": nccl_only}
    single = ModelRunner(settings(model_dir, **fields), CUDA)
    single.warmup()
    prompts = prompts_for(single.vocab_size, [5, 41, 12])
    expected = run_requests(single, prompts, 24)
    del single
    gc.collect()
    torch.cuda.empty_cache()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    leader = ctx.Process(target=_leader_main, args=(fields, str(model_dir), prompts, queue))
    leader.start()
    try:
        graphs, got = queue.get(timeout=GROUP_TIMEOUT_S)
    finally:
        leader.join(30)
        if leader.is_alive():
            leader.kill()
    assert graphs is not None, got
    assert graphs == (not eager)
    got, path = got
    assert path.startswith("NCCL only" if nccl_only else "one-shot over peer memory"), path
    if fields["dtype"] == "float32":
        assert got == expected
    else:  # bf16: the all-reduce sums partial products in another order; allow a late divergence
        for rid, tokens in expected.items():
            assert got[rid][:8] == tokens[:8], rid


def test_a_missing_gpu_is_named() -> None:
    missing = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=f"needs GPU {missing} but only {missing} GPU"):
        resolve_device("cuda", missing)
