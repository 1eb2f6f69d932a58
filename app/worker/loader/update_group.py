"""A process group between a trainer and the workers, for broadcasting new weights.

It is separate from anything else torch.distributed does in the process: no default group is
created; the group is a bare ProcessGroupGloo / ProcessGroupNCCL over its own TCPStore at the
trainer's master_address:master_port. The store keys are laid out as torch's
`_new_process_group_helper` lays them out for a group named `group_name` created over
`PrefixStore(group_name, store)`: the way SGLang-compatible trainers create their end of the
group (`init_custom_process_group`), so such trainers can join it unchanged. The trainer is rank 0
(the store's master) and broadcasts from it; the workers are ranks rank_offset + worker rank.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")
DEFAULT_TIMEOUT_S = 600.0
_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}  # the device key torch's helper prefixes with


def _backend_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    outer = dist.PrefixStore(group_name, store)
    return dist.PrefixStore(f"{_BACKEND_DEVICE[backend]}/", dist.PrefixStore(f"{group_name}/", outer))


@dataclass
class UpdateGroup:
    name: str
    backend: str
    rank: int
    world_size: int
    store: dist.Store
    group: dist.ProcessGroup

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Receive (or, at src, send) one tensor over the group, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.group.broadcast([tensor], opts).wait()

    @property
    def device(self) -> torch.device:
        """Where received tensors must live: NCCL needs the GPU, gloo works on host tensors."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def destroy(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()


def open_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> UpdateGroup:
    """Join (rank > 0) or host (rank 0, the trainer) the group; blocks until every rank has joined."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not supported: use one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on a CPU worker")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout)
    prefixed = _backend_store(store, group_name, backend)
    if backend == "gloo":
        group: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return UpdateGroup(group_name, backend, rank, world_size, store, group)
