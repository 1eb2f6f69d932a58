"""The worker process: owns the device, executes the scheduler's step plans.

Failure policy: a sequence the runner cannot run (its sampling parameters, its token ids) is refused
alone (StepResult.failed_slots, HTTP 400) and NaN/inf logits fail their row alone (bad_slots, 500): the
step's other sequences carry on. A step that raises (a device error, OOM, a scheduler fault) fails the
requests in it (StepResult.error, HTTP 500) and the worker goes on; MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row mean the device state is broken,
and the worker exits 1, which brings the appliance down (the container restarts it). Its loop beats a
liveness heartbeat at least every second while idle and after every step; a wedged step stops it.

Pipelining: the scheduler keeps two steps in flight, and the worker launches a plan as soon as it
arrives, before it reads the tokens of the step still running (ModelRunner.launch / finish), so the
GPU does not wait for the host (staging, sampling launches, the token readback, IPC) between steps.
Results still go out in step order, and a failure in the later step's launch cannot hold back the
earlier step's result. On the CPU a launch computes the whole step before it returns, so there is no
device to keep busy: the worker sends a step's result before it launches the next (overlap off), or every
token would wait a whole step more to go out (the first one included).

Tensor parallelism (app/worker/parallel.py): only TP rank 0, the leader, has ZMQ sockets to the
scheduler. It relays every message it takes to the other ranks before acting on it (and an empty one
every idle second, their heartbeat); they run the same steps (follow_steps) and answer nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from app import ipc, lifecycle
from app import protocol as p
from app.config.settings import Settings
from app.ipc import Endpoints
from app.startup_phases import StartupClock
from app.topology import Topology, WorkerPlace
from app.worker.faults import FaultInjector

if TYPE_CHECKING:
    from app.worker.parallel import TensorParallel

log = logging.getLogger("tokenspeed.worker")

# With two steps in flight a failed step can fail the next one too (its plan assumed the first
# succeeded), so one fault may fail two steps; five in a row is a broken device, not bad luck.
MAX_CONSECUTIVE_STEP_FAILURES = 5
POLL_MS = int(lifecycle.HEARTBEAT_INTERVAL_S * 1000)
# While a step runs, the inbox and the step are checked this often: a new plan is launched within
# about this long of its arrival, well inside a step, and a finished step's result goes out as soon.
SPIN_S = 50e-6


class StepFailures(RuntimeError):
    """Too many steps failed in a row: the worker exits."""


def resolve_device(setting: str, gpu: int = 0):
    """The device this worker runs on; `gpu` is its CUDA index (app/topology.py: --base-gpu-id and
    --gpu-id-step place the ranks)."""
    import torch

    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but no CUDA GPU is visible (check --gpus / nvidia runtime)")
        visible = torch.cuda.device_count()
        if gpu >= visible:
            raise RuntimeError(
                f"this worker needs GPU {gpu} but only {visible} GPU(s) are visible: --tensor-parallel-size x "
                "--data-parallel-size workers per node, placed from --base-gpu-id every --gpu-id-step, need more "
                "GPUs than this node has (check CUDA_VISIBLE_DEVICES and the container's GPU reservation)")
        return torch.device("cuda", gpu)  # set_device needs an index (torch 2.11)
    return torch.device(setting)


def set_cpu_threads(torch, workers: int = 1) -> None:
    """Leave two cores to the http, tokenizer and scheduler processes, and share the rest among this
    node's workers (app/worker/cpu_host.py: the cores of the CPU set and cgroup quota, not the host's).

    torch's OpenMP threads spin-wait for each other at every op: when a core they expect is busy
    with another process, each op waits for a scheduler time slice (seen here: 2 s per SmolLM2 decode
    step with 2 threads on a loaded 2-core machine, 60 ms with 1). OMP_NUM_THREADS, when set, wins.
    """
    from app.worker.cpu_host import available_cores, worker_threads

    if "OMP_NUM_THREADS" not in os.environ:
        cores = available_cores()
        torch.set_num_threads(worker_threads(cores, workers))
        log.info("torch threads: %d (%d usable cores, %d CPU worker(s))", torch.get_num_threads(), cores, workers)


def run_worker(settings: Settings, endpoints: Endpoints, place: WorkerPlace | None = None, init_method: str = "") -> None:
    """Process entry (multiprocessing spawn target). The TP leader serves its replica's scheduler; the other
    ranks follow the messages it relays (app/worker/parallel.py)."""
    place = place or WorkerPlace(0, 0, 1, 0, "worker0")
    lifecycle.init_child(place.name, settings.log_level)
    ctx = zmq.Context()
    phases = ipc.connect_push(ctx, endpoints.inbox("supervisor"))  # start-up phases, for /readiness
    clock = StartupClock(place.name, lambda msg: ipc.send(phases, msg))
    clock.enter("init")  # imports, the device, the TP group
    import torch

    from app.worker.model_runner import ModelRunner
    from app.worker.parallel import TensorParallel

    device = resolve_device(settings.device, place.gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_cpu_threads(torch, Topology.from_settings(settings).per_node)
    tp = TensorParallel.join(place.rank, place.tp_size, device, init_method,
                            custom_all_reduce=not settings.disable_custom_all_reduce)
    runner = ModelRunner(settings, device, tp, clock)
    runner.warmup()
    ready = runner.ready_message()
    log.info("%s ready on %s: %s", place.name, device, ready.info)

    heartbeat = lifecycle.Heartbeat.attach(endpoints.runtime_dir, place.name)
    lifecycle.on_sigterm(lambda: os._exit(0))  # nothing to flush: device state dies with us
    try:
        with torch.inference_mode():
            if tp.leader:
                _lead(runner, ready, place, endpoints, ctx, heartbeat, tp)
            else:
                supervisor = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
                lifecycle.settle_heap()
                ipc.send(supervisor, p.ProcessReady(place.name, os.getpid()))
                follow_steps(runner, tp, heartbeat)
    finally:
        ctx.destroy(linger=0)
    if tp.size > 1 and device.type == "cuda":
        os._exit(0)  # an NCCL group that CUDA graphs captured cannot be torn down (app/worker/parallel.py)


def _lead(runner, ready: p.WorkerReady, place: WorkerPlace, endpoints: Endpoints, ctx: zmq.Context,
          heartbeat: lifecycle.Heartbeat | None, tp: TensorParallel) -> None:
    """TP rank 0 (or the only rank): the replica's scheduler's counterpart."""
    inbox = ipc.bind_pull(ctx, endpoints.inbox("worker", place.replica))
    results = ipc.connect_push(ctx, endpoints.inbox("scheduler_results", place.replica))
    ipc.send(results, ready)
    supervisor = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
    lifecycle.settle_heap()
    ipc.send(supervisor, p.ProcessReady(place.name, os.getpid(), ready.info, runner.engine_info()))
    try:
        serve_steps(runner, inbox, results, heartbeat, FaultInjector.from_env(), relay=tp if tp.size > 1 else None,
                    overlap=runner.device.type != "cpu")
    finally:
        results.close(linger=1000)  # the last result (a failure's) must reach the scheduler


def serve_steps(runner, inbox: zmq.Socket, results: zmq.Socket, heartbeat: lifecycle.Heartbeat | None = None,
                faults: FaultInjector | None = None, relay: TensorParallel | None = None,
                overlap: bool = True) -> None:
    """Serve plans until Shutdown, at most one launched step's result unsent (see the module docstring).
    Control messages and Shutdown are handled once the step in flight is finished and its result sent.
    With tensor parallelism (`relay`), every message goes to the other ranks first, and an empty one
    every idle poll keeps their heartbeats going. overlap: see StepPipeline."""
    steps = StepPipeline(runner, lambda result: ipc.send(results, result), faults, overlap)
    while True:
        lifecycle.beat(heartbeat)
        if steps.inflight is not None:
            if not _message_first(inbox, steps.inflight):
                steps.complete()
                continue
        elif not inbox.poll(POLL_MS):
            if relay is not None:
                relay.relay(b"")
            continue
        raw = inbox.recv()
        if relay is not None:
            relay.relay(raw)
        if _handle(p.decode(raw), steps, runner, heartbeat, lambda reply: ipc.send(results, reply)):
            return


def follow_steps(runner, tp: TensorParallel, heartbeat: lifecycle.Heartbeat | None = None) -> None:
    """A TP rank other than the leader: run what the leader relays, in its order, until Shutdown. Results
    and control replies stay here (the leader answers); a failed step repeats here as on the leader."""
    steps = StepPipeline(runner, lambda result: None)
    while True:
        raw = tp.relay(None)
        lifecycle.beat(heartbeat)
        if raw and _handle(p.decode(raw), steps, runner, heartbeat, lambda reply: None):  # b"": idle tick
            return


def _handle(msg: Any, steps: StepPipeline, runner, heartbeat: lifecycle.Heartbeat | None,
            reply: Callable[[p.ControlReply], None]) -> bool:
    """One message: a plan is launched at once; anything else waits for the step in flight to finish
    (its result sent) first. True at Shutdown."""
    if isinstance(msg, p.StepPlan):
        steps.launch(msg)
        return False
    steps.complete()
    if isinstance(msg, p.Shutdown):
        return True
    if isinstance(msg, p.ControlRequest):
        reply(run_control(runner, msg, heartbeat))
    else:
        log.warning("dropping unexpected message %s", type(msg).__name__)
    return False


def _message_first(inbox: zmq.Socket, step: InFlight) -> bool:
    """Wait until a message arrives (True) or the step in flight is done on the device (False). No
    heartbeat meanwhile: a step that never completes must look wedged."""
    while True:
        if inbox.poll(0):
            return True
        if step.ready():
            return False
        time.sleep(SPIN_S)


@dataclass
class InFlight:
    """A launched step: the runner's pending handle, or the step's result when already known (it failed,
    or the runner has no launch())."""

    plan: p.StepPlan
    pending: Any = None
    result: p.StepResult | None = None

    def ready(self) -> bool:
        """Whether its result can be had without waiting for the device."""
        if self.result is not None:
            return True
        try:
            return self.pending.ready()
        except Exception:  # a device fault: finish() meets it again and fails the step
            return True


class StepPipeline:
    """Launches steps, and finishes and sends them in order; counts consecutive failures. send: where
    results go (the scheduler's socket; a list in benchmarks). overlap: launch step N+1 before reading
    step N (a device that runs asynchronously); off, step N is finished and sent first (the CPU)."""

    def __init__(self, runner, send: Callable[[p.StepResult], None], faults: FaultInjector | None = None,
                 overlap: bool = True) -> None:
        self.runner = runner
        self.send = send
        self.faults = faults
        self.overlap = overlap
        self.inflight: InFlight | None = None
        self.failures = 0

    def launch(self, plan: p.StepPlan) -> None:
        """Launch `plan`, then complete the step before it: its tokens are read once the next is queued
        (without overlap, before it is launched)."""
        if not self.overlap:
            self.complete()
        launched = launch_step(self.runner, plan, self.faults)
        self.complete()
        self.inflight = launched

    def complete(self) -> None:
        """Finish the step in flight, if any, and send its result."""
        step, self.inflight = self.inflight, None
        if step is None:
            return
        result = finish_step(self.runner, step)
        self.send(result)
        if result.error is not None:
            self.failures += 1
        elif step.plan.chunks:  # a plan that only frees slots proves nothing about the device
            self.failures = 0
        if self.failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise StepFailures(f"{self.failures} consecutive steps failed (the last with {result.error}): the "
                               "device state is presumed broken; exiting so that the appliance is restarted")


def launch_step(runner, plan: p.StepPlan, faults: FaultInjector | None = None) -> InFlight:
    """Launch one step; an exception fails the step's requests, not the process. A runner with only
    execute() (a test double) runs the whole step here."""
    try:
        if faults is not None:
            return InFlight(plan, pending=faults.launch(runner, plan))
        if not hasattr(runner, "launch"):
            return InFlight(plan, result=runner.execute(plan))
        return InFlight(plan, pending=runner.launch(plan))
    except Exception as exc:
        return InFlight(plan, result=_failed(plan, exc))


def finish_step(runner, step: InFlight) -> p.StepResult:
    """The result of a launched step; an exception (a device fault surfaces here) fails the step."""
    if step.result is not None:
        return step.result
    try:
        return runner.finish(step.pending)
    except Exception as exc:
        return _failed(step.plan, exc)


def _failed(plan: p.StepPlan, exc: Exception) -> p.StepResult:
    log.error("step %d failed:\n%s", plan.step, traceback.format_exc())
    return p.StepResult(step=plan.step, error=f"{type(exc).__name__}: {exc}")


def run_control(runner, msg: p.ControlRequest, heartbeat: lifecycle.Heartbeat | None = None) -> p.ControlReply:
    """A weight operation (app/worker/loader/updates.py). It runs on a helper thread while this one keeps
    the heartbeat going: it may wait minutes on a trainer's broadcast or a disk. The scheduler sends no
    step meanwhile. A refused or failed operation leaves the weights as they were."""
    from app.worker.loader.updates import WeightControl

    control = getattr(runner, "weight_control", None)
    if control is None:
        control = runner.weight_control = WeightControl(runner)
    outcome: list[p.ControlReply] = []

    def work() -> None:
        try:
            outcome.append(p.ControlReply(msg.req_id, True, control.handle(msg.op)))
        except Exception as exc:
            log.error("%s failed: %s", msg.kind, exc, exc_info=not isinstance(exc, ValueError))
            outcome.append(p.ControlReply(msg.req_id, False, str(exc) or type(exc).__name__))

    thread = threading.Thread(target=work, name=msg.kind, daemon=True)
    thread.start()
    while thread.is_alive():
        lifecycle.beat(heartbeat)
        thread.join(lifecycle.HEARTBEAT_INTERVAL_S)
    reply = outcome[0]
    log.info("%s: %s", msg.kind, reply.message)
    tp = getattr(runner, "tp", None)
    if tp is not None and tp.size > 1:  # every rank ran it; the leader answers for all of them
        reply = _agreed(reply, msg.kind, tp.failed_ranks(reply.success))
    return reply


def _agreed(reply: p.ControlReply, kind: str, failed: list[int]) -> p.ControlReply:
    """The leader's reply, failed if any TP rank failed (checks run before any change, so a refusal is the
    same on every rank; a rank failing alone failed mid-way, e.g. reading its disk)."""
    if not failed or not reply.success:
        return reply
    return p.ControlReply(reply.req_id, False, f"{kind} failed on tensor-parallel rank(s) "
                          f"{', '.join(map(str, failed))} (see their logs) after rank 0 succeeded: the ranks' "
                          "weights may differ now; reload them (update_weights_from_disk)")
