"""A one-shot all-reduce over peer memory for tensor parallelism's small tensors (a decode step's rows);
NCCL keeps the rest.

At TP 2 NCCL takes 15-25 us to all-reduce one 8 KiB row, 64 times a step of the 8B model: about what
halving the weight reads saves at batch 1. Here each rank holds a buffer in torch's symmetric memory,
its CUDA IPC handles exchanged once at start-up; one kernel (torch.ops.symm_mem's one-shot all-reduce)
copies the local tensor into it, meets the other ranks at a barrier of signal flags, sums every rank's
buffer read over peer memory into the output, and meets them again so that no rank overwrites a buffer
another is still reading. No host sync: the decode CUDA graphs capture it like any kernel. It needs
peer access between the GPUs (P2P), not NVLink multicast.

Every rank must take the same path for the same tensor or the group hangs: the start-up checks are
agreed over the group, and the per-tensor test reads only what the ranks' tensors share (size, dtype,
layout).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Above this NCCL's ring does better than every rank reading every other rank's whole tensor (vLLM's
# and SGLang's custom all-reduces switch from one shot at about this size). 512 KiB is a decode batch
# of 64 rows of the 8B model's 4096 bf16 values.
ONE_SHOT_MAX_BYTES = 512 << 10
# The dtypes torch's one-shot kernel is built for; fp16 goes to NCCL.
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)
_ALIGN = 16  # the fused copy needs the input as aligned as the buffer's start (16 bytes)


def fits(x: torch.Tensor, max_bytes: int) -> bool:
    """Whether the one-shot kernel takes x: a dtype it is built for, contiguous, non-empty, at most
    max_bytes, a whole number of 4-byte words (its narrowest access)."""
    nbytes = x.numel() * x.element_size()
    return x.dtype in ONE_SHOT_DTYPES and x.is_contiguous() and 0 < nbytes <= max_bytes and nbytes % 4 == 0


@dataclass(frozen=True)
class Place:
    """Where a rank runs: its host and CUDA device index."""

    host: str
    gpu: int


def local_reason(enabled: bool, has_kernels: bool, places: list[Place], rank: int,
                 can_access: Callable[[int, int], bool]) -> str | None:
    """Why this rank cannot take part in the one-shot all-reduce (None: it can)."""
    if not enabled:
        return "--disable-custom-all-reduce"
    if not has_kernels:
        return "this torch build has no CUDA symmetric-memory all-reduce kernels"
    me = places[rank]
    for peer_rank, peer in enumerate(places):
        if peer_rank == rank or (peer.host, peer.gpu) == (me.host, me.gpu):  # one GPU shared: no P2P needed
            continue
        if peer.host != me.host:
            return f"rank {peer_rank} runs on another host ({peer.host})"
        if not can_access(me.gpu, peer.gpu):
            return f"GPU {me.gpu} cannot access the memory of GPU {peer.gpu} (no CUDA peer access)"
    return None


def group_reason(reasons: list[str | None]) -> str | None:
    """The group's verdict from every rank's reason: the first rank's that has one, or None."""
    for rank, reason in enumerate(reasons):
        if reason is not None:
            return f"rank {rank}: {reason}"
    return None


def has_kernel(op: str) -> bool:
    """Whether this torch has symm_mem's `op` for CUDA (the CPU wheels define the ops only; older
    releases lack some)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (its Python half: empty, rendezvous)

        return torch._C._dispatch_has_kernel_for_dispatch_key(f"symm_mem::{op}", "CUDA")
    except (ImportError, RuntimeError):
        return False


def can_access_peer(mine: int, peer: int) -> bool:
    return peer < torch.cuda.device_count() and torch.cuda.can_device_access_peer(mine, peer)


class PeerAllReduce:
    """The one-shot all-reduce over one symmetric buffer of max_bytes per rank."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int) -> None:
        self.buffer = buffer  # uint8, symmetric memory, already exchanged (rendezvous)
        self.group_name = group_name
        self.max_bytes = max_bytes
        self.fused = has_kernel("one_shot_all_reduce_copy_out")  # the copy into the buffer in the kernel

    def fits(self, x: torch.Tensor) -> bool:
        return fits(x, self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (a new tensor); x must fit."""
        n = x.numel()
        staged = self.buffer.view(x.dtype)[:n]
        out = torch.empty(n, dtype=x.dtype, device=x.device)
        flat = x.view(-1)
        if self.fused and x.storage_offset() * x.element_size() % _ALIGN == 0:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, out)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out.view(x.shape)

    @classmethod
    def start(cls, group: dist.ProcessGroup, cpu_group: dist.ProcessGroup | None, device: torch.device,
              enabled: bool, max_bytes: int = ONE_SHOT_MAX_BYTES) -> tuple[PeerAllReduce | None, str | None]:
        """Every rank of `group` calls it (cpu_group: a gloo group over the same ranks for the checks).
        Returns the group's one-shot all-reduce, or None and why the group runs NCCL alone."""
        rank = dist.get_rank(group)
        places: list[Place | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(places, Place(socket.gethostname(), device.index), group=cpu_group)
        mine = local_reason(enabled, has_kernel("one_shot_all_reduce_out"), places, rank, can_access_peer)
        reason = _agree(mine, cpu_group)
        if reason is not None:
            return None, reason
        try:  # the exchange of IPC handles: a collective over `group`'s store
            from torch.distributed import _symmetric_memory as symm_mem

            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group)
            failure = None
        except Exception as exc:  # a peer's memory that cannot be mapped: NCCL still works
            buffer, failure = None, f"the symmetric buffer could not be shared ({type(exc).__name__}: {exc})"
        reason = _agree(failure, cpu_group)
        if reason is not None:
            return None, reason
        return cls(buffer, group.group_name, max_bytes), None


def _agree(reason: str | None, cpu_group: dist.ProcessGroup | None) -> str | None:
    reasons: list[str | None] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(reasons, reason, group=cpu_group)
    return group_reason(reasons)
