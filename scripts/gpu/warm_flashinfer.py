#!/usr/bin/env python3
"""Build the JIT kernels the flashinfer backend runs for the GPU run's shapes (bf16 queries, head_dim
128, the default --block-size, the head groups of HEADS_AND_KV_DTYPES; bf16 KV: flashinfer's prefill,
Triton's decode; FP8 KV: flashinfer's prefill and xqa decode (tensor-core decode off Hopper), graphed
too; and the sampling kernels) through our backend, so the compile (~12 s decode, ~95 s prefill the
first time) overlaps other work and lands in $FLASHINFER_WORKSPACE_BASE, which the run script returns as
a tarball."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.config.settings import Settings  # noqa: E402
from app.worker.attention import AttentionSpec  # noqa: E402
from app.worker.attention.flashinfer_backend import kernels_unavailable  # noqa: E402

BLOCK_SIZE = Settings.model_fields["block_size"].default  # the appliance's --block-size (xqa builds per size)


# (query heads, KV heads) a head group of which xqa builds: Llama-3.1-8B's (bf16 and FP8 KV), then
# Qwen3-30B-A3B's (FP8 KV: its bf16 cache decodes on Triton, and the prefill kernels are the same).
HEADS_AND_KV_DTYPES = (((32, 8), torch.bfloat16), ((32, 8), torch.float8_e4m3fn), ((32, 4), torch.float8_e4m3fn))


def main() -> None:
    """The attention kernels of HEADS_AND_KV_DTYPES, then the sampling kernels (--sampling-backend flashinfer)."""
    started = time.perf_counter()
    for (heads, kv_heads), kv_dtype in HEADS_AND_KV_DTYPES:
        spec = AttentionSpec(heads, kv_heads, 128, 128**-0.5, q_dtype=torch.bfloat16)
        problem = kernels_unavailable(spec, kv_dtype, torch.device("cuda"), BLOCK_SIZE)
        if problem is not None:
            raise SystemExit(f"flashinfer ({heads}/{kv_heads} heads, {kv_dtype} KV): {problem}")
        print(f"flashinfer backend's decode, prefill and graph decode ({heads}/{kv_heads} heads, {kv_dtype} KV) "
              f"ready after {time.perf_counter() - started:.1f} s", flush=True)
    from app.worker.sampling.flashinfer_sampler import load_flashinfer_sampling

    load_flashinfer_sampling(torch.device("cuda"))
    print(f"flashinfer sampling ready after {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
