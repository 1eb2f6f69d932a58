"""CUDA graphs for prefill and mixed steps, in pieces cut at each layer's attention.

An eager step queues about nine kernels a layer from Python whatever its size: 10 to 27 ms of host
work for the 8B model on the H200 machines measured, so for short prompts (or a prompt mostly in the
prefix cache) the GPU waits for the host, and that wait is most of the time to first token. Of a layer's work only the attention depends on the
batch's layout (how the tokens split into sequences, their context lengths); every other kernel sees
a flat [T, hidden] batch. So the forward is captured per token bucket in L + 1 pieces (vLLM's
piecewise CUDA graphs): piece i runs layer i-1's output projection and MLP, then layer i's norm, QKV
projection, rotary embedding and KV write, and copies the rotated queries into a static buffer; the
attention runs eagerly between pieces, planned for the real batch as usual (the backend's `attend`),
into a static output buffer that the next piece reads. The last piece ends with the final norm.

A step of T tokens replays the smallest bucket B >= T. Rows T..B are padding: their K/V go to the
scratch block (the KV cache holds one block beyond the scheduler's pool), the attention never reads
them, and nothing reads their outputs. The kernels are those of the eager forward at B rows, so the
real rows' results are the eager forward's at B rows.

Every piece of every bucket shares one memory pool; the buffers that cross a cut are allocated
outside it. Buckets never run concurrently (one stream), so a bucket's transient tensors may reuse
another's memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from app.worker.attention import AttentionBackend, AttentionBatch, AttentionMetadata
from app.worker.cuda_graphs import CapturedSizes

# Below a few hundred tokens a step is bound by reading the weights, so padding it costs little; from
# 512 up the buckets are 128 tokens apart (a quarter of a step at most). Past ~2000 tokens the GPU's
# work outlasts the host's and a graph saves little.
SMALL_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512)
LARGE_STEP = 128


def bucket_sizes(max_tokens: int) -> list[int]:
    """The token buckets that cover every step of 1 to max_tokens tokens."""
    if max_tokens < 1:
        return []
    sizes = [b for b in SMALL_BUCKETS if b < max_tokens]
    if max_tokens <= SMALL_BUCKETS[-1]:
        return sizes + [next(b for b in SMALL_BUCKETS if b >= max_tokens)]
    top = -(-max_tokens // LARGE_STEP) * LARGE_STEP
    return sizes + list(range(SMALL_BUCKETS[-1] + LARGE_STEP, top + 1, LARGE_STEP))


@dataclass
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph]
    layers: list[int]  # the layer whose attention runs after graphs[i]


@dataclass
class _StaticSlots:
    """What a backend's forward reads of the step before it attends: the slots its new K/V go to (the
    bucket's static buffer)."""

    slot_mapping: torch.Tensor


class _Cutter:
    """Wraps the backend while a bucket's forward runs for capture. The model calls forward here as on
    the backend, and the backend's own forward runs: it writes the new K/V to the bucket's static slots,
    then attends. Its attention, the one part that depends on the batch's layout, is where the piece
    ends instead: the rotated queries go to a static buffer, the current graph ends and the next begins
    (warming up, the layers are only recorded), and the attention's static output buffer stands in for
    its result. So the pieces run exactly the backend's forward, whatever its arguments."""

    def __init__(self, owner: PiecewiseGraphs, size: int, pool: tuple | None) -> None:
        self.owner, self.size, self.pool = owner, size, pool
        self.pieces = _Pieces([], [])
        self.meta = AttentionMetadata(backend=self, batch=_StaticSlots(owner.slot_mapping[:size]))  # type: ignore[arg-type]
        if pool is not None:
            self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.graphs.append(graph)

    def end(self) -> None:
        if self.pool is not None:
            self.pieces.graphs[-1].capture_end()

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        backend = self.owner.backend
        backend.attend = self._cut  # type: ignore[method-assign]  # supports_piecewise_graphs: forward ends in self.attend
        try:
            return backend.forward(*args, **kwargs)
        finally:
            del backend.attend  # the class's attend again

    def _cut(self, layer_idx: int, q: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        owner, size = self.owner, self.size
        owner.queries[:size].copy_(q)
        self.pieces.layers.append(layer_idx)
        self.end()
        if self.pool is not None:
            self._begin()
        return owner.attn_out[:size]


class PiecewiseGraphs(CapturedSizes):
    """Captured pieces of the forward per token bucket (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        sizes: list[int],
        scratch_slot: int,
        hidden_size: int,
        device: torch.device,
    ) -> None:
        super().__init__(sizes)
        if not backend.supports_piecewise_graphs:
            raise ValueError(f"the {backend.name} attention backend cannot run between graph pieces")
        self.model = model
        self.backend = backend
        self.scratch_slot = scratch_slot
        self.device = device
        largest = self.max_size
        spec = backend.spec
        dtype = model.dtype
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), scratch_slot, dtype=torch.int64, device=device)
        self.queries = torch.zeros(largest, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(largest, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        self.pieces: dict[int, _Pieces] = {}

    def _forward(self, size: int, pool: tuple | None) -> _Pieces:
        cutter = _Cutter(self, size, pool)
        hidden = self.model(self.input_ids[:size], self.positions[:size], cutter.meta)
        self.hidden[:size].copy_(hidden)
        cutter.end()
        return cutter.pieces

    def capture(self) -> None:
        """Warm each bucket's kernels eagerly, then capture its pieces (all rows padding)."""
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # capture needs a stream other than the default
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size, None)
                stream.synchronize()
                self.pieces[size] = self._forward(size, pool)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - started

    def stage(self, input_ids: torch.Tensor, batch: AttentionBatch) -> int:
        """Write the step's input ids, positions and KV slots into the static buffers, the pad rows'
        slots onto the scratch block; returns the bucket."""
        num = batch.num_tokens
        size = self.size_for(num)
        if size is None:
            raise ValueError(f"a step of {num} tokens exceeds the largest bucket {self.max_size}")
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(batch.positions)
        self.slot_mapping[:num].copy_(batch.slot_mapping)
        self.slot_mapping[num:size].fill_(self.scratch_slot)  # earlier, longer steps left real slots here
        return size

    def run(self, input_ids: torch.Tensor, batch: AttentionBatch, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states [T, hidden] (a view of a static buffer that the next run
        overwrites): the pieces of its bucket replay and the backend attends between them with the
        step's metadata."""
        pieces = self.pieces[self.stage(input_ids, batch)]
        num = batch.num_tokens
        pieces.graphs[0].replay()
        for layer, graph in zip(pieces.layers, pieces.graphs[1:], strict=True):
            self.backend.attend(layer, self.queries[:num], meta, out=self.attn_out[:num])
            graph.replay()
        return self.hidden[:num]
