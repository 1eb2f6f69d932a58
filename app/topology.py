"""Where the engine processes go: data-parallel replicas, each a tensor-parallel group of workers,
placed over nodes and GPUs.

Replica d has one scheduler and --tensor-parallel-size workers (TP ranks 0..tp-1), which form their own
torch.distributed group (replicas share nothing, so each has its own rendezvous). TP rank 0, the leader,
takes the scheduler's messages over ZMQ and relays them to the other ranks over the group
(app/worker/parallel.py); only the leader answers. With --nnodes > 1 (one replica) the group's ranks are
spread over the nodes in order, node n running ranks n*per_node ... (n+1)*per_node - 1; node 0 runs http,
the tokenizer, the scheduler and the leader, the other nodes only workers and a health endpoint.

Process names (logs, heartbeats, the supervisor's messages): with one replica `scheduler` and
`worker<rank>`; with several, `scheduler<d>` and `worker<d>.<rank>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config.settings import Settings


@dataclass(frozen=True)
class WorkerPlace:
    replica: int
    rank: int  # TP rank within the replica
    tp_size: int
    gpu: int  # CUDA device index on this node (unused on CPU)
    name: str

    @property
    def leader(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Topology:
    tp: int
    dp: int
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    dist_init_addr: str | None = None

    @classmethod
    def from_settings(cls, s: Settings) -> Topology:
        return cls(
            tp=s.tensor_parallel_size,
            dp=s.data_parallel_size,
            nnodes=s.nnodes,
            node_rank=s.node_rank,
            base_gpu_id=s.base_gpu_id,
            gpu_id_step=s.gpu_id_step,
            dist_init_addr=s.dist_init_addr,
        )

    @property
    def head(self) -> bool:
        """Node 0 serves HTTP and runs the schedulers."""
        return self.node_rank == 0

    @property
    def per_node(self) -> int:
        return self.tp * self.dp // self.nnodes

    def scheduler_name(self, replica: int) -> str:
        return "scheduler" if self.dp == 1 else f"scheduler{replica}"

    def worker_name(self, replica: int, rank: int) -> str:
        return f"worker{rank}" if self.dp == 1 else f"worker{replica}.{rank}"

    def schedulers(self) -> list[int]:
        """The replicas whose scheduler runs on this node."""
        return list(range(self.dp)) if self.head else []

    def local_workers(self) -> list[WorkerPlace]:
        """The workers this node runs, in global order (replica-major)."""
        first = self.node_rank * self.per_node
        places = []
        for local in range(self.per_node):
            replica, rank = divmod(first + local, self.tp)
            gpu = self.base_gpu_id + local * self.gpu_id_step
            places.append(WorkerPlace(replica, rank, self.tp, gpu, self.worker_name(replica, rank)))
        return places
