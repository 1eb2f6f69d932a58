"""A worker's tensor-parallel group (app/topology.py says who is in it) on torch.distributed.

Two process groups over the same ranks: the device group (NCCL on CUDA, gloo on CPU) carries the
model's collectives (all-reduce after row-parallel layers, the logits' all-gather, the sampled tokens'
broadcast); a gloo group carries the leader's relay of the scheduler's messages, which are host bytes.
On CPU the two are the same gloo group. On CUDA a small all-reduce (a decode step's rows) runs as one
kernel over peer memory instead of NCCL (app/worker/peer_all_reduce.py) unless
--disable-custom-all-reduce or the GPUs cannot reach each other's memory.

`SINGLE` stands for no parallelism: its collectives are identities, so layers call them unconditionally.
"""

from __future__ import annotations

import datetime
import logging
import struct

import torch
import torch.distributed as dist

from app.worker.peer_all_reduce import PeerAllReduce

log = logging.getLogger("tokenspeed.worker")

# The relay broadcasts one fixed-size frame per message (8-byte length, then the payload); a message
# longer than the frame follows in a second broadcast. Most step plans fit: one collective per message.
RELAY_FRAME_BYTES = 16 << 10
_LENGTH = struct.Struct("<q")
# Ranks wait this long for each other (start-up: the slowest rank's weight loading; then the leader
# relays an idle tick every second, so a live group never comes near it).
GROUP_TIMEOUT = datetime.timedelta(minutes=30)


class TensorParallel:
    """This process's rank in a TP group of `size` ranks."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank = rank
        self.size = size

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, rank: int, size: int, device: torch.device, init_method: str, *,
             custom_all_reduce: bool) -> TensorParallel:
        """Rendezvous with the other ranks at init_method (tcp://host:port). custom_all_reduce: the
        one-shot all-reduce for small tensors on CUDA (not --disable-custom-all-reduce)."""
        if size == 1:
            return SINGLE
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and device.index is None:  # NCCL binds to one device, named by index
            device = torch.device("cuda", torch.cuda.current_device())
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                                timeout=GROUP_TIMEOUT, **kwargs)
        group = Distributed(rank, size, device, custom_all_reduce)
        log.info("tensor parallel rank %d of %d joined (%s, %s); all-reduce: %s", rank, size, backend,
                 init_method, group.all_reduce_path)
        return group

    @property
    def all_reduce_path(self) -> str:
        """What runs the all-reduces, in words (logs, benchmark results)."""
        return "none (one rank)"

    # Identities at size 1; Distributed overrides them.
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def min_int(self, value: int) -> int:
        return value

    def relay(self, payload: bytes | None) -> bytes:
        if payload is None:
            raise RuntimeError("a single-rank group has nobody to relay from")
        return payload

    def failed_ranks(self, ok: bool) -> list[int]:
        """The ranks whose `ok` is False (every rank calls it)."""
        return [] if ok else [self.rank]

    def close(self) -> None:
        pass


SINGLE = TensorParallel()


class Distributed(TensorParallel):
    def __init__(self, rank: int, size: int, device: torch.device, custom_all_reduce: bool) -> None:
        super().__init__(rank, size)
        self.device = device
        self.cpu_group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if device.type == "cuda" else None
        self._frame = torch.empty(RELAY_FRAME_BYTES, dtype=torch.uint8)
        self.one_shot: PeerAllReduce | None = None
        self.nccl_only_reason: str | None = None  # on CUDA without the one-shot all-reduce: why
        if device.type == "cuda":
            self.one_shot, self.nccl_only_reason = PeerAllReduce.start(
                dist.group.WORLD, self.cpu_group, device, custom_all_reduce)

    @property
    def all_reduce_path(self) -> str:
        if self.device.type != "cuda":
            return "gloo"
        if self.one_shot is None:
            return f"NCCL only ({self.nccl_only_reason})"
        return (f"one-shot over peer memory (torch symmetric memory) for bf16/fp32 tensors up to "
                f"{self.one_shot.max_bytes >> 10} KiB, NCCL above")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, in rank order."""
        flat = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(flat, x.contiguous().view(-1))
        return torch.cat(flat.view(self.size, *x.shape).unbind(0), dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The leader's x, on every rank (in place)."""
        dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest value any rank holds (e.g. KV blocks: every rank must hold the same pool)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def failed_ranks(self, ok: bool) -> list[int]:
        flags = torch.zeros(self.size, dtype=torch.int64)
        flags[self.rank] = 0 if ok else 1
        dist.all_reduce(flags, group=self.cpu_group)
        return [rank for rank, failed in enumerate(flags.tolist()) if failed]

    def relay(self, payload: bytes | None) -> bytes:
        """The leader passes a message (bytes) and every other rank gets it back; blocks until it has."""
        frame = self._frame
        if self.leader:
            assert payload is not None
            head = _LENGTH.pack(len(payload)) + payload[: RELAY_FRAME_BYTES - _LENGTH.size]
            frame[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self.cpu_group)
        (length,) = _LENGTH.unpack(frame[: _LENGTH.size].numpy().tobytes())
        first = min(length, RELAY_FRAME_BYTES - _LENGTH.size)
        if self.leader:
            rest = payload[first:]
            if rest:
                dist.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8), src=0, group=self.cpu_group)
            return payload
        data = frame[_LENGTH.size: _LENGTH.size + first].numpy().tobytes()
        if length > first:
            rest = torch.empty(length - first, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.cpu_group)
            data += rest.numpy().tobytes()
        return data

    def close(self) -> None:
        """Leave the group (CPU only). With NCCL, destroying a communicator that CUDA graphs captured
        hangs (pytorch/pytorch#115388): a CUDA rank keeps its group until its process exits."""
        if dist.is_initialized() and self.device.type != "cuda":
            dist.destroy_process_group()
