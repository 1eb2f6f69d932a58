"""The choice between the one-shot all-reduce over peer memory and NCCL (app/worker/peer_all_reduce.py):
which tensors the kernel takes (dtype, size threshold, layout), which groups can run it (the setting,
the torch build, hosts, CUDA peer access), and the group's agreement. The kernel itself runs in
tests/gpu/test_peer_all_reduce_gpu.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from app.config import Settings
from app.worker import peer_all_reduce as par
from app.worker.peer_all_reduce import ONE_SHOT_MAX_BYTES, Place, fits, group_reason, local_reason

HOST = "node-a"


@pytest.mark.parametrize(("shape", "dtype", "ok"), [
    ((1, 4096), torch.bfloat16, True),  # one decode row of the 8B model: 8 KiB
    ((64, 4096), torch.bfloat16, True),  # exactly the threshold
    ((65, 4096), torch.bfloat16, False),  # one row over: NCCL
    ((32, 4096), torch.float32, True),
    ((33, 4096), torch.float32, False),
    ((1, 4096), torch.float16, False),  # torch's kernel has no fp16
    ((3,), torch.bfloat16, False),  # 6 bytes: not whole 4-byte words
    ((0, 4096), torch.bfloat16, False),
])  # fmt: skip
def test_which_tensors_the_one_shot_kernel_takes(shape: tuple[int, ...], dtype: torch.dtype, ok: bool) -> None:
    assert fits(torch.empty(shape, dtype=dtype), ONE_SHOT_MAX_BYTES) is ok


def test_a_strided_view_goes_to_nccl() -> None:
    x = torch.empty(8, 4096, dtype=torch.bfloat16)
    assert fits(x[:, :2048], ONE_SHOT_MAX_BYTES) is False
    assert fits(x[2:4], ONE_SHOT_MAX_BYTES) is True  # rows of a contiguous tensor: contiguous


def test_the_threshold_is_512_kib() -> None:
    assert ONE_SHOT_MAX_BYTES == 512 * 1024


def reason(places: list[Place], rank: int = 0, enabled: bool = True, kernels: bool = True,
           peers: set[tuple[int, int]] | None = None) -> str | None:
    """local_reason with peer access between the GPU pairs in `peers` (every pair when None)."""
    return local_reason(enabled, kernels, places, rank, lambda a, b: peers is None or (a, b) in peers)


def test_two_gpus_with_peer_access_run_one_shot() -> None:
    assert reason([Place(HOST, 0), Place(HOST, 1)], rank=1) is None


def test_the_setting_turns_it_off() -> None:
    assert reason([Place(HOST, 0), Place(HOST, 1)], enabled=False) == "--disable-custom-all-reduce"
    assert Settings(model="m").disable_custom_all_reduce is True  # off until measured on two GPUs


def test_a_torch_without_the_kernels_runs_nccl() -> None:
    assert "no CUDA symmetric-memory all-reduce kernels" in reason([Place(HOST, 0), Place(HOST, 1)], kernels=False)


def test_no_peer_access_runs_nccl_and_names_the_gpus() -> None:
    places = [Place(HOST, 0), Place(HOST, 1), Place(HOST, 2)]
    assert reason(places, rank=0, peers={(0, 1)}) == "GPU 0 cannot access the memory of GPU 2 (no CUDA peer access)"


def test_ranks_on_another_host_run_nccl() -> None:
    assert reason([Place(HOST, 0), Place("node-b", 0)]) == "rank 1 runs on another host (node-b)"


def test_ranks_sharing_one_gpu_need_no_peer_access() -> None:
    assert reason([Place(HOST, 0), Place(HOST, 0)], peers=set()) is None


def test_the_group_takes_the_first_rank_with_a_reason() -> None:
    assert group_reason([None, None]) is None
    assert group_reason([None, "x", "y"]) == "rank 1: x"


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_start_agrees_over_the_group_and_says_why(one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    group, cpu = dist.group.WORLD, torch.device("cpu")
    assert par.PeerAllReduce.start(group, None, cpu, enabled=False) == (None, "rank 0: --disable-custom-all-reduce")
    assert par.PeerAllReduce.start(group, None, cpu, enabled=True) == (
        None, "rank 0: this torch build has no CUDA symmetric-memory all-reduce kernels")
    # A build with the kernels whose buffer cannot be shared: NCCL, and the error in the reason.
    monkeypatch.setattr(par, "has_kernel", lambda op: True)
    one_shot, why = par.PeerAllReduce.start(group, None, cpu, enabled=True)
    assert one_shot is None
    assert why is not None and why.startswith("rank 0: the symmetric buffer could not be shared (")
