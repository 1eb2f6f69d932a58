"""Which CUDA graphs a worker captures, what they will cost, and their capture.

Two kinds (app/worker/cuda_graphs.py, app/worker/piecewise_graphs.py): whole decode steps by batch
size, and prefill/mixed steps in token buckets, cut around attention. Their memory is measured before
the KV pool is sized (profile_graph_bytes) and reserved there; the graphs themselves are captured after
it, over the real KV cache.
"""

from __future__ import annotations

import logging
import math

import torch

from app.config.settings import Settings
from app.worker.attention import (
    AttentionBackend,
    backend_class,
    build_attention_batch,
    make_attention_backend,
)
from app.worker.cuda_graphs import CapturedSizes, DecodeGraphs, capture_sizes
from app.worker.kv_cache import GIB
from app.worker.memory_plan import Workload, split
from app.worker.parallel import TensorParallel
from app.worker.piecewise_graphs import PiecewiseGraphs, bucket_sizes

logger = logging.getLogger(__name__)

# Per-graph bookkeeping the graph-memory profile cannot see (graph objects, small per-size buffers).
GRAPH_OVERHEAD_BYTES = 64 << 20


def decode_graph_sizes(settings: Settings, device: torch.device, backend: str, max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture, in rows (a sequence verifying k drafts is k + 1 rows); none on the
    CPU, with --enforce-eager, or with a backend that cannot be captured (torch)."""
    if device.type != "cuda" or settings.enforce_eager:
        return []
    if not backend_class(backend).supports_cuda_graphs:
        logger.info("CUDA graphs off: the %s attention backend runs eagerly", backend)
        return []
    rows_per_seq = 1 + settings.speculative_num_steps if settings.speculative_algorithm is not None else 1
    return capture_sizes(settings.cudagraph_capture_sizes, settings.max_cudagraph_capture_size,
                         max_num_seqs * rows_per_seq)


def piece_sizes(settings: Settings, decode_sizes: list[int], backend: str, tp: TensorParallel,
                max_step_tokens: int) -> list[int]:
    """Token buckets of the piecewise graphs for prefill and mixed steps: with the decode graphs, on
    one GPU (a TP group would capture its collectives in every piece: not built), for a backend
    that attends apart from its KV write."""
    if not decode_sizes or tp.size > 1:
        return []
    if not backend_class(backend).supports_piecewise_graphs:
        return []
    return bucket_sizes(min(settings.piecewise_cuda_graph_max_tokens, max_step_tokens))


def profile_graph_bytes(w: Workload, decode_sizes: list[int], pieces: list[int]) -> int:
    """Memory the CUDA graphs will take, measured before the pool is sized."""
    return _decode_graph_bytes(w, decode_sizes) + _piece_bytes(w, pieces)


def _piece_bytes(w: Workload, sizes: list[int]) -> int:
    """The piecewise graphs' pool: twice an eager forward of the largest bucket (buckets never run at
    once, so they share it, but the captures fragment it: 0.62 GiB at 2048 tokens of the 8B model,
    about twice the eager peak); their static buffers come on top."""
    if not sizes:
        return 0
    dev, size = w.device, max(sizes)
    query_lens = split(size, w.max_model_len)
    num_blocks = math.ceil(max(query_lens) / w.block_size)
    backend = make_attention_backend(w.attention_backend, w.scratch_cache(num_blocks), w.model.attention_spec)
    table = torch.arange(num_blocks, dtype=torch.int32, device=dev).repeat(len(query_lens), 1)
    batch = build_attention_batch(table, query_lens, query_lens, w.block_size)
    input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.no_grad():
        w.model(input_ids, batch.positions, backend.plan(batch))
    torch.cuda.synchronize(dev)
    spec = w.model.attention_spec
    static = size * (2 * spec.num_heads * spec.head_dim + w.model.dims.hidden) * w.dtype.itemsize
    return 2 * (torch.cuda.max_memory_allocated(dev) - base) + static + 3 * 8 * size + GRAPH_OVERHEAD_BYTES


def _decode_graph_bytes(w: Workload, sizes: list[int]) -> int:
    """The attention backend's own buffers, one eager decode step of the largest capture size at
    max_model_len context (the graphs share one pool, largest captured first, so it holds about one
    such step), the static logits buffer and a per-graph allowance."""
    if not sizes:
        return 0
    dev, size = w.device, max(sizes)
    num_blocks = math.ceil(w.max_model_len / w.block_size)
    cache = w.scratch_cache(num_blocks)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    backend = make_attention_backend(w.attention_backend, cache, w.model.attention_spec)
    backend_bytes = torch.cuda.memory_allocated(dev) - before
    table = torch.arange(num_blocks, dtype=torch.int32, device=dev).repeat(size, 1)
    batch = build_attention_batch(table, [1] * size, [w.max_model_len] * size, w.block_size)
    input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.no_grad():
        w.model.compute_logits(w.model(input_ids, batch.positions, backend.plan(batch)))
    torch.cuda.synchronize(dev)
    step_bytes = torch.cuda.max_memory_allocated(dev) - base
    logits_bytes = size * w.vocab_size * 4
    return backend_bytes + step_bytes + logits_bytes + GRAPH_OVERHEAD_BYTES


def capture_decode_graphs(w: Workload, attention: AttentionBackend, sizes: list[int], max_blocks: int,
                          scratch_block: int, capture_layers: tuple[int, ...] = ()) -> DecodeGraphs | None:
    """capture_layers: the layers whose input the graphs also collect (EAGLE-3; HiddenCapture)."""
    if not sizes:
        return None
    graphs = DecodeGraphs(w.model, attention, sizes, max_blocks, w.block_size, scratch_block, w.vocab_size,
                          w.device, capture_layers)
    graphs.capture()
    logger.info(
        "CUDA graphs: %d decode sizes (%d..%d) captured in %.1f s, using %.2f GiB",
        len(graphs.sizes),
        graphs.sizes[0],
        graphs.max_size,
        graphs.capture_seconds,
        graphs.memory_bytes / GIB,
    )
    return graphs


def capture_pieces(w: Workload, attention: AttentionBackend, sizes: list[int],
                   scratch_block: int, capture_layers: tuple[int, ...] = ()) -> PiecewiseGraphs | None:
    if not sizes:
        return None
    pieces = PiecewiseGraphs(w.model, attention, sizes, scratch_block * w.block_size, w.model.dims.hidden,
                             w.device, capture_layers)
    try:
        pieces.capture()
    except Exception as exc:
        raise RuntimeError(f"capturing the piecewise CUDA graphs failed ({type(exc).__name__}: {exc}); "
                           "--piecewise-cuda-graph-max-tokens 0 runs prefill and mixed steps eagerly") from exc
    logger.info(
        "CUDA graphs: prefill and mixed steps in %d token buckets (%d..%d), %d pieces each, captured in "
        "%.1f s, using %.2f GiB",
        len(pieces.sizes),
        pieces.sizes[0],
        pieces.max_size,
        len(pieces.pieces[pieces.max_size].graphs),
        pieces.capture_seconds,
        pieces.memory_bytes / GIB,
    )
    return pieces


def captured_bytes(*graphs: CapturedSizes | None) -> int:
    """The memory the captured graphs hold (None: not captured)."""
    return sum(g.memory_bytes for g in graphs if g is not None)


def check_graph_memory(used: int, reserved: int) -> None:
    if used > reserved:
        logger.warning("CUDA graphs use %.2f GiB, more than the %.2f GiB reserved for them before sizing the "
                       "KV pool", used / GIB, reserved / GIB)
