"""The scheduler side of the RL control plane: pause modes, draining around weight updates, chunked
updates whose version waits for finish_weight_update."""

from __future__ import annotations

from app import protocol as p
from app.scheduler.rl_control import EngineControl
from app.scheduler.scheduler import Scheduler, SchedulerConfig


class Harness:
    def __init__(self) -> None:
        self.sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128, max_num_seqs=4,
                                               chunked_prefill_size=64, max_prefill_tokens=128,
                                               enable_prefix_caching=True, eos_token_ids=(0,)))
        self.to_worker: list[p.ControlRequest] = []
        self.replies: list[p.ControlReply] = []
        self.deltas: list[p.TokenDelta] = []
        self.control = EngineControl(self.sched, self.to_worker.append, self.replies.append, self.deltas.extend)

    def add(self, rid: str, max_new: int = 3, prompt: list[int] | None = None) -> None:
        self.sched.add_request(p.TokenizedRequest(rid, prompt or list(range(1, 10)),
                                                  p.SamplingParams(max_new_tokens=max_new, temperature=0)))

    def step(self) -> bool:
        """One loop iteration as the scheduler process runs it (no overlap)."""
        self.control.advance(self.sched.num_inflight_steps)
        if not self.control.stepping_allowed:
            return False
        plan = self.sched.schedule()
        if plan is None:
            return False
        slots = [c.slot for c in plan.chunks if c.sample]
        self.sched.process_result(p.StepResult(step=plan.step, slots=slots, token_ids=[7] * len(slots)))
        return True

    def request(self, op: p.ControlOp) -> str:
        req_id = f"{op.KIND}-{len(self.replies)}-{len(self.to_worker)}"
        assert self.control.handle(p.ControlRequest(req_id, op))
        return req_id

    def worker_answers(self, success: bool = True, message: str = "Updated 3 tensors.") -> None:
        sent = self.to_worker[-1]
        self.control.on_worker_reply(p.ControlReply(sent.req_id, success, message))


def test_pause_and_continue_in_place() -> None:
    h = Harness()
    h.add("r")
    assert h.step()
    h.request(p.PauseGeneration("in_place"))
    assert h.replies[-1].success and h.replies[-1].message == "Paused generation."
    assert not h.step() and len(h.sched.running) == 1
    h.add("queued")  # requests queue while paused
    assert not h.step() and len(h.sched.waiting) == 1
    h.request(p.ContinueGeneration())
    while h.step():
        pass
    assert not h.sched.has_work()


def test_pause_abort_and_retract() -> None:
    h = Harness()
    h.add("a")
    h.step()
    h.request(p.PauseGeneration("retract"))
    assert not h.sched.running and [r.rid for r in h.sched.waiting] == ["a"]
    h.request(p.PauseGeneration("abort"))
    assert [(d.rid, d.finish_reason) for d in h.deltas] == [("a", "abort")] and not h.sched.requests
    h.request(p.PauseGeneration("sideways"))
    assert not h.replies[-1].success and "sideways" in h.replies[-1].message


def test_a_weight_update_drains_the_engine_first_then_flushes_and_reports_the_version() -> None:
    h = Harness()
    h.add("running", max_new=4)
    h.step()
    op = p.UpdateWeightsFromDistributed(names=["x"], dtypes=["float32"], shapes=[[1]], group_name="g",
                                        flush_cache=True, weight_version="v2")
    h.request(op)
    h.add("later")
    h.control.advance(0)
    assert h.to_worker == [] and not h.sched.admission_open  # running requests finish first
    while h.step():
        pass
    assert [r.rid for r in h.sched.waiting] == ["later"] and not h.sched.running
    (sent,) = h.to_worker
    assert sent.op == op  # the worker reads only its own fields
    assert not h.control.stepping_allowed  # the worker is busy
    assert h.sched.kv.num_cached_blocks > 0
    h.worker_answers()
    reply = h.replies[-1]
    assert reply.success and reply.result == p.WeightIdentity("v2") and "Weight version updated to v2" in reply.message
    assert h.sched.kv.num_cached_blocks == 0  # flushed: cached KV came from the old weights
    h.control.advance(0)
    assert h.sched.admission_open
    while h.step():
        pass
    assert not h.sched.has_work()


def test_a_failed_update_changes_nothing_and_omitted_version_is_kept() -> None:
    h = Harness()
    h.request(p.UpdateWeightsFromTensor(b"..", flush_cache=False, weight_version="v9"))
    h.control.advance(0)
    h.worker_answers(False, "weights not updated: tensor x has shape [2]")
    assert h.replies[-1] == p.ControlReply(h.to_worker[-1].req_id, False, "weights not updated: tensor x has shape [2]")
    h.request(p.UpdateWeightsFromTensor(b"..", flush_cache=False))
    h.control.advance(0)
    h.worker_answers()
    assert h.replies[-1].success and h.replies[-1].result == p.WeightIdentity()


def test_disk_reload_always_flushes_and_reports_the_model_path() -> None:
    h = Harness()
    h.add("r", max_new=1)
    while h.step():
        pass
    assert h.sched.kv.num_cached_blocks > 0
    h.request(p.UpdateWeightsFromDisk("/ckpt/step-2"))
    h.control.advance(0)
    assert h.to_worker[-1].op == p.UpdateWeightsFromDisk("/ckpt/step-2")
    h.worker_answers()
    assert h.replies[-1].result == p.WeightIdentity(None, "/ckpt/step-2") and h.sched.kv.num_cached_blocks == 0


def test_while_paused_an_update_runs_at_once_and_the_paused_requests_stay_out_of_the_cache() -> None:
    h = Harness()
    h.add("r", max_new=20)
    h.step()
    h.request(p.PauseGeneration())
    h.request(p.UpdateWeightsFromTensor(b"..", flush_cache=True))
    h.control.advance(0)
    assert len(h.to_worker) == 1
    h.worker_answers()
    (req,) = h.sched.running
    assert not req.cacheable
    h.request(p.ContinueGeneration())
    while h.step():
        pass
    assert h.sched.kv.num_cached_blocks == 0  # nothing of its mixed-version KV was cached


def test_chunked_update_defers_version_and_flush_until_finish() -> None:
    h = Harness()
    h.add("r", max_new=1)
    while h.step():
        pass
    h.request(p.StartWeightUpdate())
    h.control.advance(0)
    assert h.replies[-1].success and h.control.session is not None
    h.add("waits")
    assert not h.step() and not h.control.stepping_allowed
    h.request(p.UpdateWeightsFromTensor(b"1", flush_cache=True, weight_version="v3"))
    h.control.advance(0)
    h.worker_answers()
    assert h.replies[-1].success and h.replies[-1].result is None
    assert "deferred" in h.replies[-1].message and h.sched.kv.num_cached_blocks > 0
    h.request(p.UpdateWeightsFromTensor(b"2", flush_cache=False))
    h.control.advance(0)
    h.worker_answers()
    h.request(p.FinishWeightUpdate())
    h.control.advance(0)
    assert h.replies[-1].success and h.replies[-1].result == p.WeightIdentity("v3")
    assert h.sched.kv.num_cached_blocks == 0 and h.control.session is None
    while h.step():
        pass
    assert not h.sched.has_work()
    h.request(p.FinishWeightUpdate("v4"))
    h.control.advance(0)
    assert not h.replies[-1].success and "start_weight_update" in h.replies[-1].message


def test_group_operations_wait_for_steps_in_flight_only() -> None:
    h = Harness()
    h.add("r", max_new=5)
    h.step()
    h.request(p.InitWeightsUpdateGroup("127.0.0.1", 1, rank_offset=1, world_size=2, group_name="g", backend="gloo"))
    h.control.advance(1)
    assert h.to_worker == []
    h.control.advance(0)
    assert h.to_worker[-1].kind == "init_weights_update_group" and h.sched.admission_open
    h.worker_answers(message="Joined")
    assert h.replies[-1].message == "Joined" and h.control.stepping_allowed
    assert not h.control.paused and h.control.session is None and h.control.num_queued == 0
