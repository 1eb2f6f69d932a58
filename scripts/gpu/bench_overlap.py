#!/usr/bin/env python3
"""Can a decode step run its attention and its GEMMs at the same time? The offline run's decode step
(512 sequences of ~1,500 tokens, FP8 weights and FP8 KV) spends ~11 ms a step in xqa attention, bound by
the cache's bytes, and ~5 ms in FP8 GEMMs, bound by the tensor cores: run one after the other, as every
step runs them now, they add up. Split into two halves A and B, one half's attention can run on one
stream while the other half's GEMMs run on another (the dataflow of a layer allows it: attention(A, l)
needs the GEMMs of A up to layer l, not those of B).

Per layer of the Llama-3.1-8B shape (32 heads, 8 KV heads, head_dim 128, 16-token blocks scattered over
the pool; the GEMMs between two attentions: o_proj, gate_up, down, the next layer's qkv; torch._scaled_mm
row-wise with fast accumulation, as app/worker/quantization/gemm.py calls it), timed inside CUDA graphs
of LAYERS layers (KV layers and weight sets alternated so nothing stays in L2):
  attention / GEMMs alone, at the whole batch and at each half;
  serial: attention(all) then GEMMs(all), as the appliance runs a step now;
  overlap: the halves' dataflow on two streams.

  python3 scripts/gpu/bench_overlap.py [--json OUT] [--batch 512] [--context 1500] [--splits 256,384]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.worker.attention import AttentionSpec, build_attention_batch  # noqa: E402
from app.worker.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from app.worker.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from app.worker.quantization.fp8 import quantize_rows  # noqa: E402
from app.worker.quantization.gemm import _scaled_mm_rowwise  # noqa: E402
from scripts.gpu.bench_gemv import SHAPES, time_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LAYERS = 8  # a graph's layers; KV layers and weight sets alternate between them
FP8 = torch.float8_e4m3fn


class Step:
    """One decode step's pieces over `batch` sequences of `context` tokens, cut at each split."""

    def __init__(self, batch: int, context: int, gen: torch.Generator) -> None:
        dev = torch.device("cuda")
        per_seq = math.ceil(context / BLOCK)
        blocks = batch * per_seq + 1
        self.cache = KVCache(KVCacheSpec(2, KV_HEADS, HEAD_DIM, FP8), blocks, BLOCK, dev)
        for layer in range(2):
            self.cache.k[layer].copy_(torch.randn(self.cache.k[layer].shape, device=dev).to(FP8))
            self.cache.v[layer].copy_(torch.randn(self.cache.v[layer].shape, device=dev).to(FP8))
        order = torch.randperm(blocks - 1, generator=gen)[: batch * per_seq].to(dev, torch.int32)
        self.tables = order.view(batch, per_seq)
        self.spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, q_dtype=torch.bfloat16)
        self.batch, self.context = batch, context
        self.q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.weights = []  # two sets: {layer name: (codes, scales)}
        for s in range(2):
            g = torch.Generator(dev).manual_seed(s)
            one = {}
            for name, (n, k) in SHAPES.items():
                codes, scale = quantize_rows(torch.randn(n, k, device=dev, generator=g) * 0.02)
                one[name] = (codes, scale.view(1, -1).float())  # [1, N]: what _scaled_mm wants
            self.weights.append(one)
        self.x = {name: quantize_rows(torch.randn(batch, k, device=dev)) for name, (_, k) in SHAPES.items()}
        self.backends: dict[tuple[int, int], tuple[FlashInferAttentionBackend, object]] = {}

    def attention(self, lo: int, hi: int) -> Callable[[int], None]:
        """xqa over sequences lo..hi (a backend per slice: each has its own xqa workspace)."""
        if (lo, hi) not in self.backends:
            backend = FlashInferAttentionBackend(self.cache, self.spec, decode_kernel="xqa")
            rows = hi - lo
            meta = backend.plan(build_attention_batch(self.tables[lo:hi], [1] * rows, [self.context] * rows, BLOCK))
            self.backends[lo, hi] = (backend, meta)
        backend, meta = self.backends[lo, hi]
        return lambda layer: backend.attend(layer % 2, self.q[lo:hi], meta, self.out[lo:hi])

    def gemms(self, lo: int, hi: int) -> Callable[[int], None]:
        def run(layer: int) -> None:
            for name in ("o", "gate_up", "down", "qkv"):
                codes, scale = self.x[name]
                w, w_scale = self.weights[layer % 2][name]
                _scaled_mm_rowwise(codes[lo:hi], scale[lo:hi], w, w_scale, torch.bfloat16)

        return run


def graph_ms(body: Callable[[], None]) -> float:
    """Per layer: the median replay of a CUDA graph of body (which runs LAYERS layers)."""
    return time_ms(lambda _: body(), 1) / LAYERS


def layers(*pieces: Callable[[int], None]) -> Callable[[], None]:
    def body() -> None:
        for layer in range(LAYERS):
            for piece in pieces:
                piece(layer)

    return body


def overlapped(attn_a: Callable, attn_b: Callable, gemm_a: Callable, gemm_b: Callable) -> Callable[[], None]:
    """The halves' dataflow on two streams: attention on the capture stream, GEMMs on a side stream;
    gemm(X, l) waits for attention(X, l), attention(X, l + 1) for gemm(X, l). In the steady state
    attention(B, l) runs beside gemm(A, l) and attention(A, l + 1) beside gemm(B, l)."""
    side = torch.cuda.Stream()

    def body() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        gemm_done = {"a": None, "b": None}
        for layer in range(LAYERS):
            for half, attn, gemm in (("a", attn_a, gemm_a), ("b", attn_b, gemm_b)):
                if gemm_done[half] is not None:
                    main.wait_event(gemm_done[half])
                attn(layer)
                attn_done = torch.cuda.Event()
                attn_done.record(main)
                side.wait_event(attn_done)
                with torch.cuda.stream(side):
                    gemm(layer)
                gemm_done[half] = torch.cuda.Event()
                gemm_done[half].record(side)
        main.wait_stream(side)

    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--splits", default="256", help="where half A ends (comma-separated: one row each)")
    args = parser.parse_args()
    step = Step(args.batch, args.context, torch.Generator().manual_seed(0))
    n = args.batch
    whole = {"attention": graph_ms(layers(step.attention(0, n))), "gemms": graph_ms(layers(step.gemms(0, n)))}
    whole["serial"] = graph_ms(layers(step.attention(0, n), step.gemms(0, n)))
    rows = []
    for split in map(int, args.splits.split(",")):
        a, b = (step.attention(0, split), step.attention(split, n))
        ga, gb = (step.gemms(0, split), step.gemms(split, n))
        row = {"batch": n, "context": args.context, "split": split, **{f"all_{k}_ms": v for k, v in whole.items()},
               "attention_a_ms": graph_ms(layers(a)), "attention_b_ms": graph_ms(layers(b)),
               "gemms_a_ms": graph_ms(layers(ga)), "gemms_b_ms": graph_ms(layers(gb)),
               "serial_halves_ms": graph_ms(layers(a, b, ga, gb)),
               "overlap_ms": graph_ms(overlapped(a, b, ga, gb))}  # fmt: skip
        row["overlap_bound_ms"] = max(row["attention_a_ms"] + row["attention_b_ms"],
                                      row["gemms_a_ms"] + row["gemms_b_ms"])  # fmt: skip
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("| batch x context | split | attention | GEMMs | serial (now) | halves serial | overlap | overlap / serial |"
          " bound (max) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} x {r['context']} | {r['split']} | {r['all_attention_ms'] * 1e3:.0f} us | "
              f"{r['all_gemms_ms'] * 1e3:.0f} us | {r['all_serial_ms'] * 1e3:.0f} us | "
              f"{r['serial_halves_ms'] * 1e3:.0f} us | {r['overlap_ms'] * 1e3:.0f} us | "
              f"{r['overlap_ms'] / r['all_serial_ms']:.3f} | {r['overlap_bound_ms'] * 1e3:.0f} us |")


if __name__ == "__main__":
    main()
