#!/usr/bin/env python3
"""xqa decode over an FP8 cache by cache layout and block size: does the cache's shape change how fast
TensorRT-LLM's decode kernel reads it? The appliance stores each layer's K and V as [blocks, block_size,
KV heads, head_dim] (NHD: a head's 16 tokens are 128-byte rows 1 KiB apart); TensorRT-LLM's own cache is
[blocks, KV heads, block_size, head_dim] (HND: a head's tokens contiguous) with 32 or 64 tokens a block.
One layer of the offline run's decode step (512 sequences of 1,500 tokens, Llama-3.1-8B heads), blocks in
pool order (as a fresh pool hands them out) and scattered; time per call (CUDA graph of 20 calls over 2
alternated layers, median of 10 replays) and the KV bytes' rate against the copy bandwidth of this run.

  python3 scripts/gpu/bench_xqa_layout.py [--json OUT] [--block-sizes 16,32,64] [--batch 512] [--context 1500]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.worker.attention.flashinfer_backend import XQA_WORKSPACE_BYTES, import_flashinfer  # noqa: E402
from scripts.bench_latency import copy_bandwidth, read_bandwidth  # noqa: E402
from scripts.gpu.bench_gemv import time_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
FP8 = torch.float8_e4m3fn


def run_case(fi, block: int, order: str, batch: int, context: int) -> list[dict]:
    """Both layouts over the same values (HND: the NHD cache's copy with heads and tokens swapped)."""
    dev = torch.device("cuda")
    per_seq = math.ceil(context / block)
    blocks = batch * per_seq
    gen = torch.Generator(dev).manual_seed(0)
    nhd = [torch.randn(blocks, block, KV_HEADS, HEAD_DIM, device=dev, generator=gen).to(FP8) for _ in range(4)]
    ids = torch.arange(blocks, device=dev, dtype=torch.int32)
    if order == "scattered":
        ids = ids[torch.randperm(blocks, device=dev, generator=gen)]
    tables = ids.view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev).view(torch.uint32)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(q)
    workspace = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2
    rows, first = [], None
    for layout in ("NHD", "HND"):
        caches = nhd if layout == "NHD" else [c.permute(0, 2, 1, 3).contiguous() for c in nhd]

        def call(i: int, caches=caches, layout=layout) -> torch.Tensor:
            k, v = caches[2 * (i % 2)], caches[2 * (i % 2) + 1]
            return fi.decode.xqa_batch_decode_with_kv_cache(
                q, (k, v), workspace, tables, lens, per_seq * block, bmm1_scale=HEAD_DIM**-0.5,
                bmm2_scale=1.0, out=out, kv_layout=layout, enable_pdl=False,
            )  # fmt: skip

        got = call(0).float().clone()
        first = got if first is None else first
        ms = time_ms(call, 20)
        rows.append({"block": block, "layout": layout, "order": order, "ms": ms, "tb_s": kv_bytes / ms / 1e9,
                     "diff_vs_nhd": ((got - first).norm() / first.norm()).item()})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--block-sizes", default="16,32,64")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context", type=int, default=1500)
    args = parser.parse_args()
    fi = import_flashinfer()
    copy = copy_bandwidth(torch.device("cuda")) / 1e12
    read = read_bandwidth(torch.device("cuda")) / 1e12
    rows = []
    for block in map(int, args.block_sizes.split(",")):
        for order in ("pool order", "scattered"):
            for row in run_case(fi, block, order, args.batch, args.context):
                row["share_of_copy"] = row["tb_s"] / copy
                rows.append(row)
                print(row, flush=True)
            torch.cuda.empty_cache()  # the case's caches, gone with its frame
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_tb_s": copy, "read_tb_s": read, "rows": rows}, indent=1) + "\n")
    print(f"copy bandwidth {copy:.2f} TB/s, read (torch sum) {read:.2f} TB/s; {args.batch} sequences x {args.context} tokens, FP8 KV, one layer")
    print("| block | blocks | layout | time | KV TB/s | share of copy | output vs NHD |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['block']} | {r['order']} | {r['layout']} | {r['ms'] * 1e3:.0f} us | {r['tb_s']:.2f} | "
              f"{r['share_of_copy']:.3f} | {r['diff_vs_nhd']:.1e} |")


if __name__ == "__main__":
    main()
