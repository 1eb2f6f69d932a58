"""Where the engine processes go (app/topology.py): names, TP ranks, replicas, nodes and GPUs."""

from __future__ import annotations

from app.topology import Topology


def places(topo: Topology) -> list[tuple[str, int, int, int]]:
    return [(w.name, w.replica, w.rank, w.gpu) for w in topo.local_workers()]


def test_one_replica_keeps_the_plain_names() -> None:
    topo = Topology(tp=2, dp=1)
    assert topo.scheduler_name(0) == "scheduler" and topo.schedulers() == [0]
    assert places(topo) == [("worker0", 0, 0, 0), ("worker1", 0, 1, 1)]
    assert [w.leader for w in topo.local_workers()] == [True, False]


def test_replicas_of_tp_groups_fill_the_gpus_in_order() -> None:
    topo = Topology(tp=2, dp=2)
    assert [topo.scheduler_name(d) for d in topo.schedulers()] == ["scheduler0", "scheduler1"]
    assert places(topo) == [("worker0.0", 0, 0, 0), ("worker0.1", 0, 1, 1), ("worker1.0", 1, 0, 2),
                            ("worker1.1", 1, 1, 3)]


def test_base_gpu_id_and_step_place_the_workers() -> None:
    assert [w.gpu for w in Topology(tp=2, dp=1, base_gpu_id=4, gpu_id_step=2).local_workers()] == [4, 6]


def test_nodes_split_one_tp_group_and_only_node_0_schedules() -> None:
    head = Topology(tp=4, dp=1, nnodes=2, node_rank=0, dist_init_addr="10.0.0.1:29500")
    other = Topology(tp=4, dp=1, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500")
    assert head.head and not other.head and other.schedulers() == []
    assert places(head) == [("worker0", 0, 0, 0), ("worker1", 0, 1, 1)]
    assert places(other) == [("worker2", 0, 2, 0), ("worker3", 0, 3, 1)]  # local GPU indices restart
