"""A launched step's results on their way to the host: the sampled ids, bad-row flags and logprobs are
copied through page-locked memory without blocking (app/worker/model_runner.py's launch), and turned
into a StepResult once the copy's event has fired (finish)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.protocol import StepResult, TokenLogprobs
from app.worker.sampling import SamplerOutput
from app.worker.sampling.grammar import Deferred, GrammarRows
from app.worker.sampling.logprobs import DeviceLogprobs
from app.worker.sampling.prompt_logprobs import PromptLogprobs


@dataclass
class PendingStep:
    """A launched step: its device work is queued and its results are being copied to the host.
    It holds all that finish() reads, so later launches may change the runner's state freely."""

    step: int
    slots: list[int] = field(default_factory=list)  # the slots that sampled, in row order
    readback: torch.Tensor | None = None  # host int64 [sampled ids, bad-row flags]; None: none sampled
    logprobs: DeviceLogprobs | None = None
    logprobs_host: torch.Tensor | None = None  # host copy of logprobs.packed
    copied: torch.cuda.Event | None = None  # recorded after the copies (CUDA); None: already on the host
    failed: dict[int, str] = field(default_factory=dict)  # sequences refused at launch: slot -> why
    grammar: Deferred | None = None  # constrained rows whose matchers await these tokens
    prompt: PromptLogprobs | None = None  # prompt logprobs computed in this step (TP leader)

    def ready(self) -> bool:
        """Whether finish() would return without waiting for the device."""
        return self.copied is None or self.copied.query()


def start_readback(step: int, slots: list[int], out: SamplerOutput, device: torch.device) -> PendingStep:
    """Start copying the sampled ids, bad-row flags and logprobs to the host (on the CPU: keep them)."""
    packed = torch.cat([out.token_ids, out.bad.to(torch.int64)])
    logprobs = out.device_logprobs
    pending = PendingStep(step, slots, packed, logprobs, logprobs.packed if logprobs else None)
    if device.type == "cuda":
        pending.readback = to_host(packed)
        pending.logprobs_host = to_host(logprobs.packed) if logprobs else None
        pending.copied = torch.cuda.Event()
        pending.copied.record()
    return pending


def step_result(pending: PendingStep, grammar: GrammarRows) -> StepResult:
    """Wait for a launched step's results and build its StepResult (its constrained rows' matchers
    take their tokens first)."""
    extra: dict[str, Any] = {"failed_slots": list(pending.failed), "failed_errors": list(pending.failed.values())}
    if pending.prompt is not None:
        extra["prompt_slots"], extra["prompt_logprobs"] = pending.prompt.read()
    if pending.readback is None:
        return StepResult(step=pending.step, **extra)
    if pending.copied is not None:
        pending.copied.synchronize()
    n = len(pending.slots)
    host = pending.readback.numpy()
    bad_rows = np.flatnonzero(host[n:]).tolist()
    if pending.grammar is not None:  # a token its grammar refused fails its request as a bad row would
        grammar.resolve(pending.grammar)
        refused = set(pending.grammar.rejected)
        bad_rows += [i for i, slot in enumerate(pending.slots) if slot in refused and i not in bad_rows]
    logprobs: list[TokenLogprobs | None] = []
    if pending.logprobs is not None and pending.logprobs_host is not None:
        rows = pending.logprobs.unpack(pending.logprobs_host.numpy(), n, bad_rows)
        logprobs = rows if any(lp is not None for lp in rows) else []
    return StepResult(
        step=pending.step,
        slots=list(pending.slots),
        token_ids=host[:n].tolist(),
        logprobs=logprobs,
        bad_slots=[pending.slots[i] for i in bad_rows],
        **extra,
    )


def host_tokens(pending: PendingStep) -> tuple[np.ndarray, np.ndarray]:
    """A launched step's sampled ids and bad-row flags on the host, waiting for its copy if need be."""
    if pending.copied is not None:
        pending.copied.synchronize()
    assert pending.readback is not None
    host = pending.readback.numpy()
    n = len(pending.slots)
    return host[:n], host[n:]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A page-locked host tensor that `tensor` is being copied into (read it once the copy's event fired)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


