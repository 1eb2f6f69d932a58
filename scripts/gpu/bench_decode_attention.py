#!/usr/bin/env python3
"""Decode attention alone on the GPU: one layer's paged-KV decode (every sequence feeds one token) for
the Llama-3.1-8B head layout (32 query heads, 8 KV heads, head_dim 128, 16-token blocks scattered over
the pool), through each backend as the model calls it (`plan` once, then `forward`, which also writes
the new token's K/V). Reported per case: the median time of a call (CUDA events, layers alternated so
nothing stays in L2), the KV bytes it must read and the rate that makes, against the copy bandwidth
measured in the same run. Before timing, each case's output is checked against the torch backend's.

  python3 scripts/gpu/bench_decode_attention.py --json out.json

--triton-configs BLOCK_N:WARPS:STAGES[:SPLITS],... times the Triton decode kernel alone under each of
those launch options instead (the split kernel's context tile, warps and pipeline stages, and the number
of context pieces, choose_num_splits' when left out; the merge included), for both caches at the
--sweep-cases (BATCHxCONTEXT,...), each checked against the default options' output. These calls are
timed inside a CUDA graph (as the appliance runs them): at small batches a call is a few microseconds of
GPU work, which eager timing would not see under the launch overhead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.bench.latency import copy_bandwidth  # noqa: E402
from app.worker.attention import AttentionSpec, build_attention_batch  # noqa: E402
from app.worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from app.worker.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from scripts.gpu.bench_gemv import time_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LAYERS = 2  # alternated between calls
CASES = [(1, 512), (64, 1500), (256, 1500), (384, 1500), (384, 1000), (128, 4000)]  # (batch, context)


def make_backend(name: str, cache: KVCache, spec: AttentionSpec) -> Any:
    if name.startswith("flashinfer"):
        from app.worker.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(cache, spec, decode_kernel=name.removeprefix("flashinfer_"))
    from app.worker.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(cache, spec)


def run_case(backend_name: str, kv_dtype: torch.dtype, batch: int, context: int, gen: torch.Generator,
             reps: int, graph: bool = False, layers: int = LAYERS) -> dict[str, Any]:
    """graph: time the calls inside one CUDA graph (the backend's graph metadata) as the appliance runs
    decode steps; eager timing cannot see a small batch's few microseconds under the launch overhead."""
    device = torch.device("cuda")
    per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * per_seq + 1
    cache = KVCache(KVCacheSpec(layers, KV_HEADS, HEAD_DIM, kv_dtype), num_blocks, BLOCK, device)
    for layer in range(layers):  # random contents, written as the cache's dtype
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, device=device).to(kv_dtype))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, device=device).to(kv_dtype))
    order = torch.randperm(num_blocks - 1, generator=gen)[: batch * per_seq].to(device, torch.int32)
    tables = order.view(batch, per_seq)
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, q_dtype=torch.bfloat16)
    step = build_attention_batch(tables, [1] * batch, [context] * batch, BLOCK)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    backend = make_backend(backend_name, cache, spec)
    meta = backend.plan(step)
    out = backend.forward(0, q, k, v, meta)
    reference = TorchAttentionBackend(cache, spec)
    expected = reference.forward(0, q, k, v, reference.plan(step))
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    forward = backend.forward
    if graph:
        meta = backend.capture_metadata(step)
        ms = time_ms(lambda i: forward(i % layers, q, k, v, meta), reps)
    else:
        ms = median_ms(lambda i: forward(i % layers, q, k, v, meta), reps)
    del cache, backend, reference
    torch.cuda.empty_cache()
    return result_row(backend_name + (" (graph)" if graph else ""), kv_dtype, batch, context, ms, error)


def median_ms(call: Callable[[int], Any], reps: int) -> float:
    """The median of reps calls (call(i), CUDA events), the first fifth left out as warm-up."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        call(i)
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))[reps // 5:]
    return times[len(times) // 2]


def result_row(name: str, kv_dtype: torch.dtype, batch: int, context: int, ms: float, error: float) -> dict[str, Any]:
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * kv_dtype.itemsize
    return {"backend": name, "kv_dtype": str(kv_dtype).removeprefix("torch."), "batch": batch,
            "context": context, "ms": ms, "kv_gb": kv_bytes / 1e9, "tb_s": kv_bytes / ms / 1e9,
            "rel_error": error}  # fmt: skip


def run_kernel_case(kv_dtype: torch.dtype, batch: int, context: int, config: str, gen: torch.Generator,
                    reps: int) -> dict[str, Any]:
    """The Triton decode kernel alone with one BLOCK_N:WARPS:STAGES[:SPLITS] option set."""
    from tokenspeed_kernels.decode_attention import choose_num_splits, paged_decode_attention

    options = [int(v) for v in config.split(":")]
    block_n, warps, stages = options[:3]
    device = torch.device("cuda")
    per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * per_seq + 1
    caches = [torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(kv_dtype) for _ in range(4)]
    order = torch.randperm(num_blocks - 1, generator=gen)[: batch * per_seq].to(device, torch.int32)
    tables = order.view(batch, per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def call(layer: int, tuned: bool) -> torch.Tensor:
        k, v = caches[2 * layer], caches[2 * layer + 1]
        if not tuned:
            return paged_decode_attention(q, k, v, tables, seq_lens, HEAD_DIM**-0.5,
                                          choose_num_splits(batch, KV_HEADS, context, sms))
        splits = options[3] if len(options) > 3 else choose_num_splits(batch, KV_HEADS, context, sms, block_n)
        return paged_decode_attention(q, k, v, tables, seq_lens, HEAD_DIM**-0.5, splits, block_n=block_n,
                                      num_warps=warps, num_stages=stages)  # fmt: skip

    expected, out = call(0, False).float(), call(0, True).float()
    error = ((out - expected).norm() / expected.norm()).item()
    ms = time_ms(lambda i: call(i % 2, True), reps)  # per call, inside one CUDA graph of reps calls
    return result_row(f"triton {config}", kv_dtype, batch, context, ms, error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--backends", default="flashinfer_cuda_cores,flashinfer_tensor_cores,triton",
                        help="flashinfer_<decode kernel> runs FlashInferAttentionBackend with that decode kernel; "
                        "triton the triton backend")  # fmt: skip
    parser.add_argument("--triton-configs", default="",
                        help="BLOCK_N:WARPS:STAGES[:SPLITS],...: see the module docstring")
    parser.add_argument("--sweep-cases", default="384x1500,64x1500", help="BATCHxCONTEXT,... for --triton-configs")
    parser.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES),
                        help="BATCHxCONTEXT,... for the backends")  # fmt: skip
    parser.add_argument("--kv-dtypes", default="bfloat16,float8_e4m3fn", help="KV cache dtypes, in torch's names")
    parser.add_argument("--graph", action="store_true", help="time the backends' calls inside a CUDA graph")
    parser.add_argument("--layers", type=int, default=LAYERS,
                        help="cache layers the calls cycle through (more keep a small batch's KV out of L2)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    rows = []
    configs = [c for c in args.triton_configs.split(",") if c]
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    for kv_dtype in (getattr(torch, name) for name in args.kv_dtypes.split(",")):
        sweep_cases = [tuple(int(v) for v in case.split("x")) for case in args.sweep_cases.split(",")]
        for batch, context in sweep_cases if configs else []:
            for config in configs:
                try:
                    row = run_kernel_case(kv_dtype, batch, context, config, gen, args.reps)
                except Exception as exc:  # a launch option the compiler refuses must not hide the others
                    row = {"backend": f"triton {config}", "kv_dtype": str(kv_dtype), "batch": batch,
                           "context": context, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}  # fmt: skip
                row["of_copy_bandwidth"] = row.get("tb_s", 0.0) * 1e12 / bandwidth
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        for batch, context in [] if configs else cases:
            for name in args.backends.split(","):
                if name == "flashinfer_tensor_cores" and kv_dtype == torch.bfloat16:
                    continue  # the backend refuses it for a 16-bit cache
                try:
                    row = run_case(name, kv_dtype, batch, context, gen, args.reps, args.graph, args.layers)
                except Exception as exc:  # one backend failing a case must not hide the others
                    row = {"backend": name, "kv_dtype": str(kv_dtype), "batch": batch, "context": context,
                           "error": f"{type(exc).__name__}: {str(exc)[:200]}"}  # fmt: skip
                row["of_copy_bandwidth"] = row.get("tb_s", 0.0) * 1e12 / bandwidth
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bandwidth": bandwidth, "rows": rows}, indent=1))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| KV | batch x context | backend | ms | KV GB | TB/s | of copy | rel. error vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kv_dtype']} | {r['batch']} x {r['context']} | {r['backend']} | failed: {r['error']} |")
            continue
        print(f"| {r['kv_dtype']} | {r['batch']} x {r['context']} | {r['backend']} | {r['ms']:.3f} | "
              f"{r['kv_gb']:.2f} | {r['tb_s']:.2f} | {r['of_copy_bandwidth']:.2f} | {r['rel_error']:.1e} |")


if __name__ == "__main__":
    main()
