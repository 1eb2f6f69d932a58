#!/usr/bin/env python3
"""Prefill attention over an FP8 paged KV cache: flashinfer's FA2 kernels with bf16 queries (what the
flashinfer backend runs now) against its FA3 (Hopper) kernels with the queries rounded to FP8 too, which
read the FP8 cache as tensor-core operands. Llama-3.1-8B heads (32 / 8, head_dim 128), 16-token blocks
scattered over the pool, causal. Per case: the median time of a call (one layer, CUDA graph of 10 calls
over 2 alternated KV layers), TFLOP/s (causal FLOPs), and each output's relative error against float32
attention over the dequantized cache with the bf16 queries.

  python3 scripts/gpu/bench_prefill_fp8.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.worker.attention.flashinfer_backend import import_flashinfer  # noqa: E402
from scripts.gpu.bench_gemv import time_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn
# (new tokens, cached prefix) per sequence: the offline run's chunk of 8 fresh 1000-token prompts,
# a long prompt's second chunk after its first, and single prompts of 1024 and 4096.
CASES = {"8 x 1000 fresh": [(1000, 0)] * 8, "4096 after 4096": [(4096, 4096)], "1 x 1024": [(1024, 0)],
         "2 x 4096": [(4096, 0)] * 2}  # fmt: skip
K_SCALE, V_SCALE = 0.5, 0.25  # per-layer cache scales, not 1, so that both paths must apply them


def pages(seqs: list[tuple[int, int]], gen: torch.Generator, dev: torch.device):
    counts = [math.ceil((n + p) / BLOCK) for n, p in seqs]
    total = sum(counts)
    order = torch.randperm(total, generator=gen).to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([(n + p - 1) % BLOCK + 1 for n, p in seqs], dtype=torch.int32)
    qo = torch.tensor([0, *torch.tensor([n for n, _ in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    return qo, indptr, order.to(dev), last, total


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs, indptr, indices) -> torch.Tensor:
    """float32 causal attention per sequence over the dequantized cache."""
    outs, start = [], 0
    for b, (n, p) in enumerate(seqs):
        blocks = indices[int(indptr[b]) : int(indptr[b + 1])].long()
        kk = (k[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[: n + p].float() * K_SCALE).repeat_interleave(4, 1)
        vv = (v[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[: n + p].float() * V_SCALE).repeat_interleave(4, 1)
        qq = q[start : start + n].float()
        scores = torch.einsum("qhd,khd->hqk", qq, kk) * HEAD_DIM**-0.5
        mask = torch.arange(n + p, device=q.device)[None, :] > (torch.arange(n, device=q.device)[:, None] + p)
        scores.masked_fill_(mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        start += n
    return torch.cat(outs)


def run_case(name: str, seqs: list[tuple[int, int]], fi, dev: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    qo, indptr, indices, last, blocks = pages(seqs, gen, dev)
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev) * 2).to(FP8) for _ in range(4)]
    tokens = int(qo[-1])
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) * 2
    q8 = q.to(FP8)
    want = reference(q, caches[0], caches[1], seqs, indptr, indices)
    flops = sum(4 * HEADS * HEAD_DIM * n * (p + (n + 1) / 2) for n, p in seqs)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    row = {"case": name, "tokens": tokens}
    for kernel, query, qtype in (("fa2", q, torch.bfloat16), ("fa3", q8, FP8)):
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=kernel)
        wrapper.plan(qo, indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, BLOCK, causal=True,
                     sm_scale=HEAD_DIM**-0.5, q_data_type=qtype, kv_data_type=FP8, o_data_type=torch.bfloat16)
        out = torch.empty(tokens, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)

        def call(i: int, wrapper=wrapper, query=query, out=out, kernel=kernel) -> torch.Tensor:
            k, v = caches[2 * (i % 2)], caches[2 * (i % 2) + 1]
            if kernel == "fa3":  # FP8 queries: the scales go to the kernel (q, k, v), positionally
                return wrapper.run(query, (k, v), 1.0, K_SCALE, V_SCALE, out=out)
            return wrapper.run(query, (k, v), k_scale=K_SCALE, v_scale=V_SCALE, out=out)

        got = call(0).float()
        row[f"{kernel}_rel_error"] = ((got - want).norm() / want.norm()).item()
        ms = time_ms(call, 10)
        row[f"{kernel}_ms"] = ms
        row[f"{kernel}_tflop_s"] = flops / ms / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    fi, dev = import_flashinfer(), torch.device("cuda")
    rows = []
    for name, seqs in CASES.items():
        rows.append(run_case(name, seqs, fi, dev))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("| case | tokens | FA2 (bf16 q) | TFLOP/s | rel. error | FA3 (FP8 q) | TFLOP/s | rel. error | FA3 / FA2 time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['tokens']} | {r['fa2_ms'] * 1e3:.0f} us | {r['fa2_tflop_s']:.0f} | "
              f"{r['fa2_rel_error']:.1e} | {r['fa3_ms'] * 1e3:.0f} us | {r['fa3_tflop_s']:.0f} | "
              f"{r['fa3_rel_error']:.1e} | {r['fa3_ms'] / r['fa2_ms']:.2f} |")


if __name__ == "__main__":
    main()
