#!/usr/bin/env python3
"""Build flashinfer's JIT kernels for the shapes the GPU run needs (bf16 queries, head_dim 128, page 16,
bf16 and FP8 KV: batch decode, CUDA-graph decode and causal batch prefill; and the sampling kernels)
through our backend, so the compile
(~12 s decode, ~95 s prefill the first time) overlaps other work and lands in
$FLASHINFER_WORKSPACE_BASE, which the run script returns as a tarball."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.worker.attention import AttentionSpec, build_attention_batch, make_attention_backend  # noqa: E402
from app.worker.kv_cache import KVCache, KVCacheSpec  # noqa: E402


def warm(kv_dtype: torch.dtype, started: float) -> None:
    dev = torch.device("cuda")
    spec = AttentionSpec(32, 8, 128, 128**-0.5, q_dtype=torch.bfloat16)
    cache = KVCache(KVCacheSpec(1, 8, 128, kv_dtype), 16, 16, dev)
    backend = make_attention_backend("flashinfer", cache, spec)
    table = torch.arange(16, dtype=torch.int32, device=dev).view(2, 8)
    label = str(kv_dtype).removeprefix("torch.")
    for query_lens, seq_lens in (([1, 1], [20, 70]), ([20, 3], [20, 70])):
        batch = build_attention_batch(table, query_lens, seq_lens, 16)
        n = batch.num_tokens
        q = torch.randn(n, 32, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n, 8, 128, device=dev, dtype=torch.bfloat16)
        backend.forward(0, q, k, k.clone(), backend.plan(batch))
        torch.cuda.synchronize()
        print(f"flashinfer {'decode' if max(query_lens) == 1 else 'prefill'} ({label} KV) ready after "
              f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    meta = backend.capture_metadata(build_attention_batch(table, [1, 1], [20, 70], 16))
    backend.forward(0, q[:2], k[:2], k[:2].clone(), meta)
    torch.cuda.synchronize()
    print(f"flashinfer graph-mode decode ({label} KV) ready after {time.perf_counter() - started:.1f} s", flush=True)


def main() -> None:
    """bf16 KV, the FP8 (e4m3) KV cache's kernels, then the sampling kernels (--sampling-backend flashinfer)."""
    started = time.perf_counter()
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        warm(kv_dtype, started)
    from app.worker.sampling.flashinfer_sampler import load_flashinfer_sampling

    load_flashinfer_sampling(torch.device("cuda"))
    print(f"flashinfer sampling ready after {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
