"""CUDA graphs for decode steps.

Decode steps (every sequence feeds one token) of up to the largest capture size replay a captured
graph of the model's forward and LM head. A batch of B sequences runs the graph of the smallest
captured size G >= B; the G - B pad rows read and write only a scratch block (the KV cache holds one
block beyond the pool the scheduler manages), with a context of one token. Everything the graph
reads lives in persistent buffers updated in place before each replay (input ids, block tables,
context lengths; the graph derives positions and KV slots from them); the attention backend re-plans what it plans on the host
(prepare_replay). Logits land in one static [G_max, vocab] buffer shared by all graphs; sampling
runs outside the graph.

A row is one fed token of a sequence, at the position its context length says. A speculative verify
row (a sequence feeding its last token and m drafts) therefore runs as m + 1 rows of one slot with
context lengths L - m .. L: every layer writes all rows' K/V before it attends, so each row sees the
tokens before it and none after, the causal mask of an extend, at the cost of a decode batch.

All graphs share one memory pool, captured largest first so the smaller ones reuse its blocks; they
never run concurrently.

The worker queues step N+1 while step N runs. Staging writes the persistent buffers with device ops
in stream order, so that is safe; a backend that plans a replay on the host, through page-locked
buffers it reuses (flashinfer), is guarded by a PlanFence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from app.worker.attention import AttentionBackend, AttentionBatch, AttentionMetadata
from app.worker.models.dense import HiddenCapture
from app.worker.transfer import upload

logger = logging.getLogger(__name__)

# An eager decode step of the 8B model at 512 sequences with FP8 linears kept the GPU busy 31% of the
# time (host-bound); graphed, a step is GPU-bound. vLLM captures up to 512 by default too.
DEFAULT_MAX_CAPTURE_SIZE = 512
_FINE_STEP_UNTIL = 256  # sizes step by 8 up to here, then by 16 (padding costs less at large batches)


def capture_sizes(explicit: list[int] | None, max_size: int | None, max_rows: int) -> list[int]:
    """The batch sizes to capture, ascending: --cudagraph-capture-sizes if given, else 1, 2, 4, 8, every
    multiple of 8 up to 256 and of 16 above it, up to the cap; the cap is --max-cudagraph-capture-size
    (default 512), never above max_rows (no decode step has more)."""
    cap = min(max_size if max_size is not None else DEFAULT_MAX_CAPTURE_SIZE, max_rows)
    if explicit:
        bad = [s for s in explicit if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"--cudagraph-capture-sizes must be positive integers, got {bad}")
        sizes = sorted({s for s in explicit if s <= cap})
        dropped = sorted({s for s in explicit if s > cap})
        if dropped:
            logger.info("CUDA graphs: not capturing sizes %s (above the cap of %d)", dropped, cap)
        return sizes
    sizes = [s for s in (1, 2, 4, 8) if s <= cap] + list(range(16, min(cap, _FINE_STEP_UNTIL) + 1, 8))
    sizes += range(_FINE_STEP_UNTIL + 16, cap + 1, 16)
    if cap not in sizes:
        sizes.append(cap)
    return sizes


class PlanFence:
    """Orders an attention backend's host-side plan buffers across pipelined steps.

    A plan may fill a page-locked host buffer that a copy queued on the stream moves to the device
    (flashinfer); planning again before the GPU ran that copy would overwrite what the previous
    step still has to read. before_plan() waits until the GPU has run the previous plan's copies,
    i.e. it has reached the previous step's forward (which then keeps it busy); after_plan() marks
    them. No-ops off CUDA, where nothing is asynchronous.
    """

    def __init__(self, device: torch.device) -> None:
        self._planned = torch.cuda.Event() if device.type == "cuda" else None

    def before_plan(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()  # returns at once before the first record

    def after_plan(self) -> None:
        if self._planned is not None:
            self._planned.record()


class CapturedSizes:
    """What every set of captured graphs shares: its sizes (batch rows or tokens), ascending; a step runs
    in the smallest that holds it. Memory and capture time are filled in by capture()."""

    def __init__(self, sizes: list[int]) -> None:
        if not sizes:
            raise ValueError(f"{type(self).__name__} needs at least one size to capture")
        self.sizes = sorted(sizes)
        self.memory_bytes = 0
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int | None:
        """The captured size that a step of n rows runs in (None: larger than any)."""
        return next((size for size in self.sizes if size >= n), None)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    meta: AttentionMetadata
    batch: AttentionBatch


class DecodeGraphs(CapturedSizes):
    """Captured decode graphs over persistent input buffers (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        sizes: list[int],
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        vocab_size: int,
        device: torch.device,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__(sizes)
        self.model = model
        # The residual stream entering these layers, side by side, per row (EAGLE-3; see HiddenCapture).
        self.capture_layers = capture_layers
        self.backend = backend
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full(
            (largest,), scratch_block * block_size, dtype=torch.int64, device=device
        )
        self.block_tables = torch.full((largest, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.logits = torch.zeros(largest, vocab_size, dtype=model.dtype, device=device)
        self.aux = torch.zeros(largest, len(capture_layers) * model.dims.hidden, dtype=model.dtype,
                               device=device) if capture_layers else None
        self.graphs: dict[int, _Captured] = {}
        self.fence = PlanFence(device)

    def _batch(self, size: int, seq_lens: list[int]) -> AttentionBatch:
        return AttentionBatch(
            query_start_loc=list(range(size + 1)),
            seq_lens=seq_lens,
            seq_lens_tensor=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size,
        )

    def locate(self, size: int) -> None:
        """The rows' positions and KV slots from the staged lengths and block tables. Part of the graph
        (fewer launches a step): only the model reads them, no backend plans with them."""
        positions = self.positions[:size]
        torch.sub(self.seq_lens[:size], 1, out=positions)
        blocks = self.block_tables[:size].gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1)
        torch.add(positions % self.block_size, blocks.to(torch.int64) * self.block_size,
                  out=self.slot_mapping[:size])

    def _forward(self, size: int, meta: AttentionMetadata) -> None:
        self.locate(size)
        if self.aux is None:
            hidden = self.model(self.input_ids[:size], self.positions[:size], meta)
        else:
            capture = HiddenCapture(self.capture_layers)
            hidden = self.model(self.input_ids[:size], self.positions[:size], meta, capture)
            self.aux[:size].copy_(capture.concatenated())
        self.model.compute_logits(hidden, out=self.logits[:size])

    def capture(self) -> None:
        """Capture every size on the pad-row state (all rows on the scratch block)."""
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for size in reversed(self.sizes):
                batch = self._batch(size, [1] * size)
                meta = self.backend.capture_metadata(batch)
                self._forward(size, meta)  # compiles / warms the kernels outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(size, meta)
                self.graphs[size] = _Captured(graph, meta, batch)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - started

    def stage(
        self,
        slots: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        last_token: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
    ) -> int:
        """Write one decode step into the persistent buffers: rows [0, B) are the slots (context lengths
        after the step), rows [B, G) pad rows on the scratch block. block_tables [max_slots, W] and
        last_token [max_slots] are the runner's per-slot device state; input_ids [B], where given, are
        the rows' tokens instead of each slot's last_token. Returns G."""
        num = len(slots)
        size = self.size_for(num)
        if size is None:
            raise ValueError(f"a decode batch of {num} exceeds the largest captured size {self.max_size}")
        pad = size - num
        dev = upload([seq_lens + [1] * pad, slots + [0] * pad], torch.int64, self.device)
        lens, index = dev[0], dev[1, :num]
        self.seq_lens[:size].copy_(lens)
        torch.index_select(block_tables, 0, index, out=self.block_tables[:num])
        if input_ids is not None:
            self.input_ids[:num].copy_(input_ids)
        else:
            assert last_token is not None, "stage needs the rows' tokens: last_token or input_ids"
            torch.index_select(last_token, 0, index, out=self.input_ids[:num])
        if pad:
            self.block_tables[num:size, 0] = self.scratch_block
            self.input_ids[num:size] = 0
        return size

    def run(
        self,
        slots: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        last_token: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step (see stage); returns logits [B, vocab], a view of the static buffer that the
        next replay overwrites."""
        size = self.stage(slots, seq_lens, block_tables, last_token, input_ids)
        captured = self.graphs[size]
        captured.batch.seq_lens = seq_lens + [1] * (size - len(slots))
        self.fence.before_plan()
        self.backend.prepare_replay(captured.meta, captured.batch)
        self.fence.after_plan()
        captured.graph.replay()
        return self.logits[: len(slots)]
