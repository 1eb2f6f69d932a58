"""The supervisor: starts the processes, waits until all are ready, watches them, stops them.

Policy: any child that dies, or that stops its liveness heartbeat for longer than --heartbeat-timeout
(--worker-heartbeat-timeout for workers: it is wedged), brings the whole appliance down with a
non-zero exit (the container's restart policy restarts it; there are no half-alive states). The
HTTP process is told first, so every request in flight gets a 503 instead of a dropped connection.
SIGTERM or SIGINT drains: the HTTP process stops admitting and lets in-flight requests finish up to
--drain-timeout, then the children stop in order (http, tokenizer, scheduler, workers) and the
supervisor exits 0. Children die with the supervisor even if it is SIGKILLed (PDEATHSIG).

What runs where is app/topology.py's: on node 0 http, the tokenizer, one scheduler per data-parallel
replica and this node's workers; on another node (--node-rank > 0) only its workers and a health-only
http (app/http/node_health.py). Each replica's TP group meets at its own rendezvous address.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass

import zmq

from app import ipc, lifecycle, model_files, startup_phases
from app import protocol as p
from app.config.settings import Settings
from app.ipc import Endpoints
from app.net import free_port
from app.topology import Topology

log = logging.getLogger("tokenspeed.supervisor")

STOP_GRACE_SECONDS = 5.0
FAIL_NOTICE_SECONDS = 10.0  # time http gets to answer its requests after an engine failure


@dataclass
class Child:
    name: str
    process: mp.process.BaseProcess
    heartbeat: lifecycle.Heartbeat


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime_dir = tempfile.mkdtemp(prefix="tokenspeed-")
        os.chmod(self.runtime_dir, 0o700)
        self.endpoints = Endpoints(self.runtime_dir)
        self.ctx = zmq.Context()
        self.inbox = ipc.bind_pull(self.ctx, self.endpoints.inbox("supervisor"))
        self.children: list[Child] = []
        self.stop_requested = False
        self.ready_info: dict[str, dict] = {}
        self.ready_engine: dict[str, p.EngineInfo] = {}  # the worker leader's and the tokenizer's parts
        # A signal writes here so the watch loop wakes at once instead of at its next poll.
        self._wake_r, self._wake_w = os.pipe()
        self.failure: str | None = None  # why the appliance is coming down, once a child failed
        self.topology = Topology.from_settings(settings)
        self.phase_seconds: dict[str, float] = {}  # the supervisor's own start-up phases (download)
        self._http_push: zmq.Socket | None = None  # start-up phases go on to http, for /readiness

    def request_stop(self) -> None:
        self.stop_requested = True
        os.write(self._wake_w, b"x")

    # ------------------------------------------------------------------ start

    def start_children(self) -> None:
        from app.http.server import run_http
        from app.scheduler.process import run_scheduler
        from app.tokenizer.process import run_tokenizer
        from app.worker.process import run_worker

        if self.settings.enable_metrics:  # before any child imports prometheus_client
            from app.metrics.exposition import prepare_multiprocess_dir

            prepare_multiprocess_dir(self.runtime_dir)
        spawn = mp.get_context("spawn")
        topo = self.topology
        if topo.head:
            targets = [("http", run_http, ()), ("tokenizer", run_tokenizer, ())]
            targets += [(topo.scheduler_name(d), run_scheduler, (d,)) for d in topo.schedulers()]
        else:
            from app.http.node_health import run_node_health

            targets = [("http", run_node_health, ())]
        rendezvous = self.rendezvous()
        targets += [(w.name, run_worker, (w, rendezvous[w.replica])) for w in topo.local_workers()]
        # Every heartbeat exists before any child starts: http looks for the engine's at its start-up.
        heartbeats = {name: lifecycle.Heartbeat.create(self.runtime_dir, name) for name, _, _ in targets}
        for name, target, extra in targets:
            args = (name, self.settings.log_level, target, self.settings, self.endpoints, *extra)
            proc = spawn.Process(target=lifecycle.run_child, args=args, name=name)
            proc.start()
            self.children.append(Child(name, proc, heartbeats[name]))
            log.info("started %s (pid %d)", name, proc.pid)

    def rendezvous(self) -> dict[int, str]:
        """Each replica's torch.distributed init address (its TP group's): --dist-init-addr across nodes,
        else a free port on this host per replica."""
        topo = self.topology
        if topo.nnodes > 1:
            return {0: f"tcp://{topo.dist_init_addr}"}
        if topo.dist_init_addr is not None:
            host, _, port = topo.dist_init_addr.rpartition(":")
            return {d: f"tcp://{host}:{int(port) + d}" for d in range(topo.dp)}
        return {d: f"tcp://127.0.0.1:{free_port()}" for d in range(topo.dp)}

    def wait_ready(self) -> bool:
        """Collect every child's ProcessReady; False if one died, a stop came, or time ran out."""
        expected = {c.name for c in self.children}
        deadline = time.monotonic() + self.settings.engine_startup_timeout
        while set(self.ready_info) != expected:
            if self.stop_requested or self._dead_child() is not None:
                return False
            if time.monotonic() > deadline:
                missing = sorted(expected - set(self.ready_info))
                log.error("start-up timed out after %ss waiting for %s", self.settings.engine_startup_timeout, missing)
                return False
            if self.inbox.poll(200):
                msg = ipc.recv(self.inbox)
                if isinstance(msg, p.ProcessReady):
                    self.ready_info[msg.name] = msg.info
                    if msg.engine is not None:
                        self.ready_engine[msg.name] = msg.engine
                    log.info("%s is ready", msg.name)
                elif isinstance(msg, p.StartupPhase):
                    self._forward_phase(msg)
        return True

    def _forward_phase(self, msg: p.StartupPhase) -> None:
        if self._http_push is None:
            self._http_push = ipc.connect_push(self.ctx, self.endpoints.inbox("http"))
        ipc.send(self._http_push, msg)

    def announce_ready(self, started: float) -> None:
        if not self.topology.head:  # a worker node: its health endpoint turns ready
            push = ipc.connect_push(self.ctx, self.endpoints.inbox("http"))
            ipc.send(push, p.EngineReady({"node_rank": self.topology.node_rank}))
            push.close(linger=1000)
            log.info("node %d ready (workers %s) in %.1f s", self.topology.node_rank,
                     ", ".join(w.name for w in self.topology.local_workers()), time.time() - started)
            return
        leader = self.topology.worker_name(0, 0)
        worker = self.ready_info.get(leader, {})
        info = {**worker, "startup_seconds": time.time() - started}
        info["startup_phases"] = {**self.phase_seconds, **worker.get("startup_phases", {})}
        engine = dataclasses.replace(
            self.ready_engine[leader],
            max_token_chars=self.ready_engine["tokenizer"].max_token_chars,
            served_model_name=self.settings.served_model_name,
            enable_metrics=bool(self.settings.enable_metrics),
            startup_seconds=info["startup_seconds"],
        )
        # The tokenizer forwards it to http once it has taken it in (see app/tokenizer/core.py).
        push = ipc.connect_push(self.ctx, self.endpoints.inbox("tokenizer"))
        ipc.send(push, p.EngineReady(info, engine))
        push.close(linger=1000)
        s = self.settings
        log.info("ready on http://%s:%d in %.1f s (serving %s); start-up phases: %s", s.host, s.port,
                 info["startup_seconds"], s.served_model_name, startup_phases.summary(info["startup_phases"]))

    # ------------------------------------------------------------------ watch and stop

    def _dead_child(self) -> Child | None:
        for child in self.children:
            if not child.process.is_alive():
                code = child.process.exitcode
                self.failure = f"{child.name} died with exit code {code}"
                log.error("%s (pid %d) died with exit code %s", child.name, child.process.pid, code)
                return child
        return None

    def heartbeat_timeout(self, name: str) -> float:
        s = self.settings
        return s.worker_heartbeat_timeout if name.startswith("worker") else s.heartbeat_timeout

    def _wedged_child(self, watches: dict[str, lifecycle.HeartbeatWatch]) -> Child | None:
        for child in self.children:
            silent, limit = watches[child.name].silent_for(), self.heartbeat_timeout(child.name)
            if silent > limit:
                flag = "--worker-heartbeat-timeout" if child.name.startswith("worker") else "--heartbeat-timeout"
                self.failure = f"{child.name} is wedged (no heartbeat for {silent:.1f} s)"
                log.error("%s (pid %d) is wedged: no heartbeat for %.1f s (%s %g); stopping the appliance",
                          child.name, child.process.pid, silent, flag, limit)
                return child
        return None

    def watch(self) -> int:
        """Block until a child dies or wedges (return 1) or a stop is requested (return 0)."""
        waitables = [c.process.sentinel for c in self.children] + [self._wake_r]
        # Silence counts from here: a start-up spent loading weights is not a wedge.
        watches = {c.name: lifecycle.HeartbeatWatch(c.heartbeat) for c in self.children}
        while not self.stop_requested:
            multiprocessing.connection.wait(waitables, timeout=0.5)
            if self._dead_child() is not None or self._wedged_child(watches) is not None:
                return 1
        return 0

    def fail_http(self) -> None:
        """After a failure: http answers every request in flight with 503 and exits, before the rest stop."""
        http = next((c for c in self.children if c.name == "http"), None)
        if http is None or not http.process.is_alive():
            return
        push = ipc.connect_push(self.ctx, self.endpoints.inbox("http"))
        ipc.send(push, p.Shutdown(self.failure or "an engine process failed"))
        push.close(linger=1000)
        http.process.join(FAIL_NOTICE_SECONDS)

    def drain_and_stop(self) -> None:
        """SIGTERM to http (it drains), then stop the rest in pipeline order."""
        http = next((c for c in self.children if c.name == "http"), None)
        if http is not None and http.process.is_alive():
            log.info("draining: waiting up to %ss for in-flight requests", self.settings.drain_timeout)
            os.kill(http.process.pid, signal.SIGTERM)
            http.process.join(self.settings.drain_timeout + STOP_GRACE_SECONDS)
        self.stop_all()

    def stop_all(self) -> None:
        order = ("http", "tokenizer", "scheduler", "worker")  # pipeline order; replicas share a rank
        for child in sorted(self.children, key=lambda c: next(i for i, k in enumerate(order)
                                                              if c.name.startswith(k))):
            proc = child.process
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_GRACE_SECONDS)
            if proc.is_alive():
                log.warning("%s did not stop in %ss: killing it", child.name, STOP_GRACE_SECONDS)
                proc.kill()
                proc.join()

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def serve(settings: Settings) -> int:
    """Run the appliance until a signal (exit 0) or a child failure (exit 1)."""
    lifecycle.configure_logging(settings.log_level, "supervisor")
    started = time.time()
    clock = startup_phases.StartupClock("supervisor")
    clock.enter("download")  # once per node, before any child starts: they read the cached copy
    try:
        model_files.prepare(settings)
    except ValueError as exc:  # ModelUnavailable too
        clock.done()
        log.error("%s", exc, exc_info=settings.log_level == "debug")
        return 1
    sup = Supervisor(settings)
    sup.phase_seconds = clock.done()

    def request_stop(signum, _frame) -> None:
        log.info("received %s: shutting down", signal.Signals(signum).name)
        sup.request_stop()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        return _run(sup, started)
    except Exception as exc:  # the supervisor's own failure: one line, the traceback only when debugging
        if settings.log_level.lower() == "debug":
            log.exception("the supervisor failed")
        else:
            log.error("the supervisor failed: %s (--log-level debug shows the traceback)", lifecycle.one_line(exc))
        return 1
    finally:
        sup.stop_all()
        sup.close()


def _run(sup: Supervisor, started: float) -> int:
    """Start, wait until ready, watch; the exit code."""
    sup.start_children()
    if not sup.wait_ready():
        sup.stop_all()
        return 0 if sup.stop_requested else 1
    sup.announce_ready(started)
    code = sup.watch()
    if code == 0:
        sup.drain_and_stop()
    else:
        sup.fail_http()
        sup.stop_all()
    log.info("stopped (exit code %d)", code)
    return code
