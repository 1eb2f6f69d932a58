"""Test-only fault injection for the worker (TOKENSPEED_TEST_FAULT): raise, NaN logits, wedge, delay.

Read once by the worker process at start; never active unless that variable is set.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from app import protocol as p
from app.config.names import TEST_FAULT_ENV

log = logging.getLogger("tokenspeed.worker")


FAULT_KINDS = ("raise", "nan", "wedge", "delay")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    """One item of TOKENSPEED_TEST_FAULT: KIND:TRIGGER[:SECONDS].

    KIND: raise (the step fails after running), nan (the logits of the matched sequences are NaN),
    wedge (the step never ends), delay (the step sleeps SECONDS first). TRIGGER: rid=PREFIX (steps
    feeding a sequence whose request id starts with PREFIX) or after=N (every step after the first N
    that feed tokens).
    """

    kind: str
    rid_prefix: str | None = None
    after: int | None = None
    seconds: float = 0.0


def parse_faults(spec: str) -> list[Fault]:
    """Comma-separated faults, e.g. "raise:rid=boom-,delay:after=0:0.05"."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, rest = item.partition(":")
        trigger, _, seconds = rest.partition(":")
        name, _, value = trigger.partition("=")
        if kind not in FAULT_KINDS or not value or name not in ("rid", "after") or (
                name == "after" and not value.isdigit()) or (kind == "delay") != bool(seconds):
            raise ValueError(f"{TEST_FAULT_ENV}: bad fault {item!r}: expected KIND:rid=PREFIX or KIND:after=N "
                             f"(KIND one of {', '.join(FAULT_KINDS)}; delay takes :SECONDS)")
        faults.append(Fault(kind, value if name == "rid" else None, int(value) if name == "after" else None,
                            float(seconds or 0)))
    return faults


class FaultInjector:
    """Runs steps through the faults of TOKENSPEED_TEST_FAULT; tests use it, production never sets it."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.rids: dict[int, str] = {}  # slot -> request id, from the plans' new sequences
        self.steps = 0  # steps that fed tokens

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(TEST_FAULT_ENV, "")
        if not spec:
            return None
        log.warning("%s=%r: injecting test faults into this worker", TEST_FAULT_ENV, spec)
        return cls(parse_faults(spec))

    def _hit(self, fault: Fault, plan: p.StepPlan) -> set[int]:
        """The slots of this step the fault applies to."""
        slots = {chunk.slot for chunk in plan.chunks}
        if fault.rid_prefix is not None:
            prefix = fault.rid_prefix
            return {slot for slot in slots if self.rids.get(slot, "").startswith(prefix)}
        return slots if fault.after is not None and self.steps > fault.after else set()

    def launch(self, runner, plan: p.StepPlan):
        """runner.launch(plan) under the faults that hit this plan; returns the runner's pending step."""
        self.rids.update({seq.slot: seq.rid for seq in plan.new_seqs})
        self.steps += bool(plan.chunks)
        hits = {kind: set() for kind in FAULT_KINDS}
        for fault in self.faults:
            if slots := self._hit(fault, plan):
                hits[fault.kind] |= slots
                if fault.kind == "delay":
                    time.sleep(fault.seconds)
        try:
            while hits["wedge"]:
                time.sleep(60)  # wedged: only the supervisor's heartbeat watch gets us out
            if hits["nan"]:
                runner.sampler.sample = _poisoned(runner.sampler.sample, hits["nan"])
            pending = runner.launch(plan)
            if hits["raise"]:
                raise InjectedFault(f"injected by {TEST_FAULT_ENV} (slots {sorted(hits['raise'])})")
            return pending
        finally:
            vars(runner.sampler).pop("sample", None)
            for slot in plan.free_slots:
                self.rids.pop(slot, None)


def _poisoned(sample, slots: set[int]):
    """sample() with the logits rows of `slots` set to NaN."""

    def run(logits, sample_slots: list[int]):
        rows = [i for i, slot in enumerate(sample_slots) if slot in slots]
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return sample(logits, sample_slots)

    return run
