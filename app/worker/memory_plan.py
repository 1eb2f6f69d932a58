"""Sizing the KV pool: profile the heaviest step the worker will run, then give the KV cache what the
memory budget leaves (CUDA), or a share of the host's memory (CPU); every tensor-parallel rank then takes
the smallest pool any rank can hold. The arithmetic itself lives with the cache (app/worker/kv_cache.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from app.config.settings import Settings
from app.protocol import SamplingParams
from app.worker.attention import build_attention_batch, make_attention_backend
from app.worker.kv_cache import GIB, KVCache, PoolPlan, cpu_pool_tokens, cuda_pool_bytes, finish_pool
from app.worker.models import DenseCausalLM
from app.worker.parallel import TensorParallel
from app.worker.sampling import Sampler

logger = logging.getLogger(__name__)

# Headroom for what the profile cannot see: the caching allocator fragments further as step shapes vary
# (measured: ~0.7 GiB beyond the profiled peak for Llama-3.1-8B shapes on an H200).
CUDA_RESERVE_BYTES = 1 << 30
# The most top logprobs a position reports: what the memory profile's heaviest sampling covers.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Workload:
    """What the worker will run, as the memory profiles reproduce it."""

    model: DenseCausalLM
    attention_backend: str
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_step_tokens: int  # the most tokens one step holds (see step_tokens)
    vocab_size: int

    def scratch_cache(self, num_blocks: int) -> KVCache:
        """A throwaway KV cache of this workload's layout."""
        return KVCache(self.model.kv_cache_spec(self.kv_dtype), num_blocks, self.block_size, self.device)


def step_tokens(settings: Settings) -> int:
    """The most tokens one step holds: the prefill chunk, or max_prefill_tokens unchunked."""
    chunk = settings.chunked_prefill_size
    return chunk if chunk is not None and chunk > 0 else settings.max_prefill_tokens


def size_pool(w: Workload, sampler: Sampler, max_total_tokens: int | None, gpu_memory_utilization: float,
              graph_bytes: Callable[[], int]) -> tuple[PoolPlan, int]:
    """The pool this rank can hold, and the bytes reserved for CUDA graphs (graph_bytes() measures them
    after the step profile; 0 on the CPU)."""
    bytes_per_token = w.model.kv_cache_spec(w.kv_dtype).bytes_per_token
    graphs = 0
    if w.device.type == "cuda":
        tokens, why, graphs = _cuda_pool_tokens(w, sampler, bytes_per_token, gpu_memory_utilization, graph_bytes)
        if max_total_tokens is not None and max_total_tokens < tokens:
            tokens, why = max_total_tokens, f"--max-total-tokens {max_total_tokens}"
    elif w.device.type == "cpu":
        import psutil  # CPU sizing only; the GPU image need not carry it

        tokens, why = cpu_pool_tokens(bytes_per_token, w.max_num_seqs, w.max_model_len, max_total_tokens,
                                      psutil.virtual_memory().available)
    else:
        raise ValueError(f"device type {w.device.type!r} is not supported (cpu or cuda)")
    return finish_pool(tokens, w.block_size, w.max_model_len, bytes_per_token, why), graphs


def agree_pool(plan: PoolPlan, tp: TensorParallel) -> PoolPlan:
    """Every TP rank holds the same blocks for the same sequences: the smallest pool any rank can hold."""
    blocks = tp.min_int(plan.num_blocks)
    if blocks == plan.num_blocks:
        return plan
    logger.info("KV pool: %d blocks here, %d on the smallest tensor-parallel rank; using %d",
                plan.num_blocks, blocks, blocks)
    return replace(plan, num_blocks=blocks)


def _cuda_pool_tokens(w: Workload, sampler: Sampler, bytes_per_token: int, util: float,
                      graph_bytes: Callable[[], int]) -> tuple[int, str, int]:
    """Profile the largest step, then give the KV cache what the utilization budget leaves."""
    dev = w.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    static = torch.cuda.memory_allocated(dev)  # weights, RoPE tables, sampler state
    static_reserved = torch.cuda.memory_reserved(dev)
    profile_kv = profile_step(w, sampler)
    torch.cuda.synchronize(dev)
    # The allocator's cached segments outgrow the live tensors (fragmentation): count the larger.
    peak = max(
        torch.cuda.max_memory_allocated(dev) - static,
        torch.cuda.max_memory_reserved(dev) - static_reserved,
    )
    peak -= profile_kv
    graphs = graph_bytes()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    non_torch = max(total - free - torch.cuda.memory_reserved(dev), 0)
    kv_bytes = cuda_pool_bytes(total, util, static, peak + graphs, non_torch, CUDA_RESERVE_BYTES)
    summary = (
        f"total {total / GIB:.2f} GiB x {util}; weights+state {static / GIB:.2f} GiB, activation peak "
        f"{peak / GIB:.2f} GiB, CUDA graphs {graphs / GIB:.2f} GiB, outside torch {non_torch / GIB:.2f} GiB, "
        f"reserve {CUDA_RESERVE_BYTES / GIB:.2f} GiB"
    )
    logger.info("memory: %s -> KV %.2f GiB", summary, kv_bytes / GIB)
    return max(kv_bytes, 0) // bytes_per_token, f"--gpu-memory-utilization {util}: {summary}", graphs


def profile_step(w: Workload, sampler: Sampler) -> int:
    """One forward + sample of the largest step on a throwaway KV cache. The step's tokens go to
    single-token decodes plus as few long chunks as max_model_len allows, so that max_num_seqs
    rows sample (the sampler peak), and every sequence sits at max_model_len context (the
    attention peak). The sequences share one block table: what they read is irrelevant here.
    Returns the bytes of that temporary cache (not activation memory)."""
    total = max(w.max_step_tokens, 1)
    num_decodes = min(w.max_num_seqs, total) - 1
    chunks = split(total - num_decodes, w.max_model_len)
    decodes = [1] * min(num_decodes, max(w.max_num_seqs - len(chunks), 0))
    # Decodes first, as the scheduler orders a step (a backend may run them apart from the chunks).
    query_lens = (decodes + chunks)[: w.max_num_seqs]
    seq_lens = [w.max_model_len] * len(query_lens)
    num_blocks = math.ceil(w.max_model_len / w.block_size)
    cache = w.scratch_cache(num_blocks)
    backend = make_attention_backend(w.attention_backend, cache, w.model.attention_spec)
    row = torch.arange(num_blocks, dtype=torch.int32, device=w.device)
    table = row.repeat(len(query_lens), 1)
    slots = list(range(len(query_lens)))
    params = _profile_params(sampler, w.vocab_size)
    for slot in slots:
        sampler.add_seq(slot, f"profile-{slot}", params, [0], [])
    try:
        with torch.no_grad():
            batch = build_attention_batch(table, query_lens, seq_lens, w.block_size)
            input_ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=w.device)
            hidden = w.model(input_ids, batch.positions, backend.plan(batch))
            last_rows = torch.tensor(batch.query_start_loc[1:], device=w.device) - 1
            sampler.sample(w.model.compute_logits(hidden.index_select(0, last_rows)), slots)
    finally:
        for slot in slots:
            sampler.remove_seq(slot)
    return cache.nbytes


def _profile_params(sampler: Sampler, vocab_size: int) -> SamplingParams:
    """The sampler's most expensive path it accepts (sorting, penalties, top logprobs)."""
    top = min(MAX_TOP_LOGPROBS, vocab_size)
    heavy = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logprobs=True,
        top_logprobs=top,
    )
    if sampler.validate(heavy) is None:
        return heavy
    return SamplingParams(temperature=0.0, logprobs=True, top_logprobs=top)


def split(total: int, limit: int) -> list[int]:
    """total tokens as pieces of at most `limit`."""
    return [limit] * (total // limit) + ([total % limit] if total % limit else [])
