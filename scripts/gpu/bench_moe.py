#!/usr/bin/env python3
"""Batch-1 decode of a MoE model on dummy weights, bf16 and FP8, beside the roofline of the bytes a token
actually reads, and transformers' `generate` on the same shape (issue 33's figures).

A MoE token reads only its k experts of every layer: the roofline here is the copy bandwidth (measured in
the same process) over the *active* weight bytes of one decode token: every parameter, less the experts
not chosen (a fraction 1 - k/E of each layer's experts) and less the embedding table (one row is read).
The bytes come from the model built on the meta device exactly as the runner builds it (FP8 codes one
byte, scales included). The runner's decode steps are timed by app/bench/latency.py (CUDA graphs as
served); transformers' decode rate is (N - 1) / (time of generate(N) - time of generate(1)).

  python scripts/gpu/bench_moe.py --model configs/models/qwen3-30b-a3b --json $OUT/moe.json
  (on the CPU, for a smoke test: --device cpu --dtype float32 with a tiny MoE model directory)

--tune instead times the expert kernels alone (each of the two projections; in a CUDA graph, as a step
runs them, over rotated routings that keep the chosen experts out of the L2) on the layer shapes of
Qwen3-30B-A3B and Mixtral, 16-bit and FP8 experts, at every token bucket of kernels/moe.py (1 to 64
tokens: the decode GEMVs and the grouped GEMMs, and the whole call both ways for the choice of shape; 128
to 4096: the grouped GEMMs), over a pruned grid of tiles, and writes the fastest per (path, experts, N, K,
weight kind, bucket) as the JSON kernels/moe_configs.json keeps (the rows of models not tuned kept):

  python scripts/gpu/bench_moe.py --tune --tune-budget 330 --json $OUT/moe_configs.json   (~6 min on an H200)
  cp moe_configs.json kernels/moe_configs.json
  TRITON_INTERPRET=1 python scripts/gpu/bench_moe.py --tune --smoke --json /tmp/t.json   (a tiny shape on the CPU)

Token counts left when --tune-budget seconds are spent are skipped (the largest last; listed in the JSON).
Compiling dominates a cold run: --tune-jobs processes (12) first compile every kernel the searches' first
phase launches, into Triton's on-disk cache.
scripts/gpu/run_h200.sh figures_moe runs the tuning, this benchmark, the GPU tests and the 1000 x 1000
offline figure in one device call. Then on the H200: pytest tests/gpu/test_moe_gpu.py (the kernels against
float64, graphs equal eager).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.bench import latency as bench_latency  # noqa: E402


def active_bytes_per_token(model_dir: str, dtype: torch.dtype, quantization: str | None) -> dict[str, float]:
    """Bytes of the model as the runner builds it (on the meta device) and the bytes one decode token
    reads: all but the experts not chosen and the embedding table."""
    from app.worker.layers.moe import FusedExperts
    from app.worker.loader import load_hf_config
    from app.worker.models import model_class_for
    from app.worker.quantization import Fp8LinearMethod, resolve_quantization

    config = load_hf_config(Path(model_dir))
    scheme = resolve_quantization(quantization, config)
    with torch.device("meta"):
        quant = Fp8LinearMethod(scheme) if scheme is not None else None
        model = model_class_for(config)(config, dtype, 64, quant=quant)

    def nbytes(module: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    total = nbytes(model)
    idle = sum(nbytes(m) * (1 - m.spec.top_k / m.spec.num_experts) for m in model.modules()
               if isinstance(m, FusedExperts))  # fmt: skip
    embed = model.model.embed_tokens
    embed_bytes = nbytes(embed) * (1 - 1 / embed.weight.shape[0]) if not model.lm_head.tied else 0
    return {"weight_bytes": total, "active_bytes_per_token": total - idle - embed_bytes}


def runner_decode(args: argparse.Namespace, quantization: str | None) -> dict[str, Any]:
    argv = ["--model", args.model, "--load-format", "dummy", "--dtype", args.dtype, "--device", args.device,
            "--batch-size", "1", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--prefill-reps", "1"]  # fmt: skip
    if quantization:
        argv += ["--quantization", quantization]
    if args.max_total_tokens:
        argv += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.attention_backend:
        argv += ["--attention-backend", args.attention_backend]
    parser = argparse.ArgumentParser()
    bench_latency.add_common_flags(parser)
    for flag, default in (("--batch-size", 1), ("--input-len", 512), ("--output-len", 128),
                          ("--chunked-prefill-size", 8192), ("--warmup-steps", 5), ("--prefill-reps", 3)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--copy-bandwidth", type=float, default=None)
    result = bench_latency.run(parser.parse_args(argv))
    gc.collect()  # the runner's modules and their parameters' loaders reference each other: free it now
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def transformers_decode(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' generate at batch 1 on the same config (random weights, the model dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    device = torch.device(args.device)
    config = AutoConfig.from_pretrained(args.model)
    dtype = getattr(torch, args.dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    prompt = torch.randint(0, config.vocab_size, (1, args.input_len), device=device)

    def generate(new: int) -> float:
        gen = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        bench_latency.sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, generation_config=gen)
        bench_latency.sync(device)
        return time.perf_counter() - t0

    generate(2)  # warm-up
    one, many = generate(1), generate(args.hf_output_len)
    return {"decode_tokens_per_s": (args.hf_output_len - 1) / (many - one), "output_len": args.hf_output_len}


# --tune: the shapes (configs/models), the token counts (every bucket of kernels/moe.py's table), and how
# long the whole sweep may take before the rest is skipped (recorded in the JSON's "skipped").
TUNE_MODELS = ("configs/models/qwen3-30b-a3b", "configs/models/mixtral-8x7b")
TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Routings a timed graph rotates over while a call's experts could fit in the 50 MB L2 (up to 64 tokens);
# past that every call reads most experts anyway, and two keep the graph short.
ROTATIONS, ROTATIONS_PREFILL = 16, 2
ROTATE_BYTES = 128 << 20  # the router's weight copies: more than the L2 holds
GEMV_TILES = [(n, k, False) for n in (2, 4, 8, 16) for k in (128, 256, 512, 1024)] + \
    [(n, k, True) for n in (16, 32, 64) for k in (64, 128, 256)]  # FMA, then tensor-core tiles  # fmt: skip
GEMV_LAUNCH = [(w, s) for w in (2, 4, 8) for s in (1, 2, 3, 4)]
GROUPED_TILES = [(n, k) for n in (64, 128) for k in (64, 128)] + [(256, 64)]  # 256 wide: the largest prefills
GROUPED_LAUNCH = [(w, s) for w in (4, 8) for s in (2, 3, 4)]
# logits a program, then columns a load: a Qwen3-30B-A3B row (2048) in one or two loads has no round trips in series
ROUTER_TILES = [(e, h) for e in (4, 8, 16, 32) for h in (128, 256, 512)] + \
    [(e, h) for e in (2, 4, 8) for h in (1024, 2048)]  # fmt: skip
ROUTER_LAUNCH = [(w, 0) for w in (1, 2, 4, 8)]  # num_warps; the router has no pipelined stages to pick


@dataclass
class TuneShape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    renormalize: bool


class Tuner:
    """Times each expert kernel alone per tile configuration (a coordinate search: the tile at 4 warps and
    3 stages, then the launch shape around the best tile; a configuration whose output differs from the
    default one's is skipped), and the whole MoE call in both shapes for the
    decode-or-grouped choice. On CUDA a run is a CUDA graph of calls back to back (ROTATIONS while the
    experts of a call could fit in the L2), each on its own routing (or router weight), so that no call finds the experts its predecessor read in the L2, as
    in a served step where every layer has its own; the figure is the replay's median over the calls.
    Timed one launch at a time instead (triton's do_bench), a 10 us kernel measured 17-40 us of host
    launch latency and the choices followed the noise. On the CPU (--smoke, under TRITON_INTERPRET=1)
    one wall-clock run checks the plumbing."""

    def __init__(self, device: torch.device, budget_s: float, smoke: bool) -> None:
        self.device, self.smoke = device, smoke
        self.times: dict[Any, float] = {}  # the last search's configurations and their us
        self.act = torch.float32 if smoke else torch.bfloat16  # the interpreter has no bfloat16
        self.deadline = time.monotonic() + budget_s
        self.configs: list[dict[str, Any]] = []
        self.choices: list[dict[str, Any]] = []
        self.skipped: list[str] = []

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def time_us(self, fn: Any, calls: int) -> float:
        """us per call of fn(i), i in range(calls): the inputs it rotates over."""
        if self.device.type != "cuda":
            fn(0)  # the interpreter's timing says nothing: one run checks the plumbing
            t0 = time.perf_counter()
            fn(0)
            return 1e6 * (time.perf_counter() - t0)
        for i in range(calls):  # compile and warm outside the graph
            fn(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        us = 1e3 * bench_latency.median_cuda_ms(graph.replay, 10) / calls
        del graph
        return us

    def search(self, run: Any, make: Any, tiles: list[tuple[int, int]], launches: list[tuple[int, int]],
               calls: int, default: Any, extra: Any = None) -> tuple[Any, float, float]:  # fmt: skip
        """(best config, its us, the default's us) of run(config, i) over make(tile, launch) configs, then
        over extra(best) (variants of the best one) if given; i: the rotated input (time_us's calls).
        self.times keeps every configuration's us."""
        self.times = times = {}
        expected = run(default, 0)

        def measure(cfg: Any) -> None:
            if cfg in times:
                return
            try:
                if not outputs_agree(run(cfg, 0), expected):
                    print(f"  skip {cfg}: its output differs from the default configuration's", file=sys.stderr)
                    return
                times[cfg] = self.time_us(lambda i: run(cfg, i), calls)
            except Exception as exc:  # a tile that does not fit (shared memory, registers)
                print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)

        measure(default)
        for tile in tiles:
            measure(make(tile, (4, 3)))
        if not times:
            raise RuntimeError("no configuration ran")
        best_tile = min(times, key=times.get)
        for launch in launches:
            measure(make(_tile_of(best_tile), launch))
        best = min(times, key=times.get)
        for cfg in extra(best) if extra is not None else ():
            measure(cfg)
        best = min(times, key=times.get)
        return best, times[best], times.get(default, float("nan"))

    def record(self, path: str, shape: TuneShape, n: int, k: int, kind: str, tokens: int,
               best: Any, best_us: float, default_us: float) -> None:  # fmt: skip
        self.configs.append({"path": path, "model": shape.name, "experts": shape.experts, "n": n, "k": k,
                             "weights": kind, "tokens": tokens, "config": asdict(best), "us": round(best_us, 2),
                             "default_us": round(default_us, 2)})  # fmt: skip
        print(f"{shape.name:>14} {kind:>4} {path:>7} [{n}x{k}] tokens {tokens:>5}: {best_us:9.1f} us {best} "
              f"(default {default_us:9.1f} us)", flush=True)  # fmt: skip


def outputs_agree(got: Any, expected: Any) -> bool:
    """A configuration's output against the default one's: the same sums in another order, so within 2% of
    the largest magnitude; a router's (weights, ids) by its weights sorted (a near tie may swap experts)."""
    if isinstance(expected, tuple):
        got, expected = got[0].sort(-1).values, expected[0].sort(-1).values
    got, expected = got.float(), expected.float()
    tolerance = 2e-2 * float(expected.abs().max()) + 1e-6
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=2e-2, atol=tolerance))


def _tile_of(cfg: Any) -> tuple[int, ...]:
    """The tile of a configuration as make() takes it: the GEMV's block_n, block_k, form and split, the grouped
    GEMM's block_m, block_n and block_k, or the router's slice and block."""
    if hasattr(cfg, "slice_e"):
        return cfg.slice_e, cfg.block_h
    if hasattr(cfg, "use_dot"):
        return cfg.block_n, cfg.block_k, cfg.use_dot, cfg.pair_split
    return cfg.block_m, cfg.block_n, cfg.block_k


@dataclass
class TuneCase:
    """One layer shape with its experts in one weight kind, ready to run."""

    shape: TuneShape
    label: str  # kernels/moe.py's weight_kind
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None


def make_case(tuner: Tuner, shape: TuneShape, kind: str) -> TuneCase:
    """Random experts of the shape, 16-bit (the activations' dtype) or FP8 codes with per-channel scales."""
    from tokenspeed_kernels import moe

    from app.worker.quantization import quantize_rows

    dev, e, h, inter = tuner.device, shape.experts, shape.hidden, shape.inter
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device=dev, generator=g) * h**-0.5
    w2 = torch.randn(e, h, inter, device=dev, generator=g) * inter**-0.5
    if kind == "fp8":
        (c13, s13), (c2, s2) = (quantize_rows(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
        return TuneCase(shape, "fp8", c13.view(w13.shape), c2.view(w2.shape), s13.view(e, -1), s2.view(e, -1))
    w13, w2 = w13.to(tuner.act), w2.to(tuner.act)
    return TuneCase(shape, moe.weight_kind(w13.dtype), w13, w2, None, None)


def tune_case(tuner: Tuner, case: TuneCase, tokens: int, decode_max: int) -> None:
    """The tiles of one case at one token count: the decode shape's (up to decode_max tokens), the grouped
    GEMMs', and there both whole calls for the decode-or-grouped choice."""
    from tokenspeed_kernels import moe

    shape, dev = case.shape, tuner.device
    e, k = shape.experts, shape.top_k
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, device=dev, generator=g).to(tuner.act)
    rotations = 1 if tuner.smoke else ROTATIONS if tokens <= 64 else ROTATIONS_PREFILL
    routings = [moe.route_topk(torch.randn(tokens, e, device=dev, generator=g), k, shape.renormalize)
                for _ in range(rotations)]  # fmt: skip
    ids = [i for _, i in routings]
    flat = [i.reshape(-1).contiguous() for i in ids]
    route = [r.reshape(-1).contiguous() for r, _ in routings]
    if tokens <= moe.ROUTER_FUSED_MAX_TOKENS and case.label != "fp8":  # the router stays 16-bit
        tune_router(tuner, case, tokens, x)
    gemv = tune_gemv(tuner, case, tokens, x, flat, route) if tokens <= decode_max else None
    grouped = tune_grouped(tuner, case, tokens, x, flat, route)
    if gemv is None:
        return

    def call(decode: bool, cfgs: Any) -> float:
        return tuner.time_us(lambda i: moe.fused_moe(x, case.w13, case.w2, route[i].view(tokens, k), ids[i],
                                                     case.s13, case.s2, decode=decode, config=cfgs), rotations)  # fmt: skip

    gemv_us, grouped_us = call(True, gemv), call(False, grouped)
    tuner.choices.append({"model": shape.name, "experts": e, "top_k": k, "hidden": shape.hidden,
                          "intermediate": shape.inter, "weights": case.label, "tokens": tokens,
                          "decode": gemv_us < grouped_us, "decode_us": round(gemv_us, 2),
                          "grouped_us": round(grouped_us, 2)})  # fmt: skip
    print(f"{shape.name:>14} {case.label:>4} tokens {tokens:>5}: whole call {gemv_us:9.1f} us decode shape, "
          f"{grouped_us:9.1f} us grouped", flush=True)  # fmt: skip


def router_grid(smoke: bool) -> tuple[list, list, Any, Any]:
    """(tiles, launches, default, make(tile, launch)) of the one-launch router."""
    from tokenspeed_kernels import moe

    def make(tile: tuple[int, int], launch: tuple[int, int]) -> Any:
        return moe.RouterConfig(*tile, launch[0])

    if smoke:
        return [(4, 16)], [(2, 0)], moe.RouterConfig(slice_e=4, block_h=32), make
    return ROUTER_TILES, ROUTER_LAUNCH, moe.RouterConfig(), make


def gemv_grid(smoke: bool, splits: tuple[int, ...] = (1,)) -> tuple[list, list, Any, Any]:
    """The same for the decode shape's GEMVs (both projections), each tile at every pair split given (the
    down kernel's: a tile that is slow read by one program a token can be the fastest over k of them)."""
    from tokenspeed_kernels import moe

    def make(tile: tuple[int, int, bool, int], launch: tuple[int, int]) -> Any:
        return moe.MoeDecodeConfig(tile[0], tile[1], *launch, use_dot=tile[2], pair_split=tile[3])

    tiles = [(4, 16, False), (16, 16, True)] if smoke else GEMV_TILES
    tiles = [(*tile, split) for tile in tiles for split in splits]
    if smoke:
        return tiles, [(2, 1)], moe.MoeDecodeConfig(block_n=8, block_k=32), make
    return tiles, GEMV_LAUNCH, moe.MoeDecodeConfig(), make


def down_splits(top_k: int) -> tuple[int, ...]:
    """The pair splits every down tile is tried at: one program a token, and one a pair."""
    return (1, top_k) if top_k > 1 else (1,)


def grouped_grid(smoke: bool, shape: TuneShape, tokens: int) -> tuple[list, list, Any, Any]:
    """The same for the grouped GEMMs at this token count: the row tiles tried are those near the pairs an
    expert gets on average."""
    from tokenspeed_kernels import moe

    def make(tile: tuple[int, ...], launch: tuple[int, int]) -> Any:
        return moe.MoeConfig(*tile, *launch)

    pairs = tokens * shape.top_k
    if smoke:
        return [(16, 16, 16)], [(4, 2)], moe.MoeConfig(16, 16, 32), make
    per_expert = max(1, pairs // shape.experts)
    block_ms = sorted({min(128, max(16, next_power_of_2(per_expert) // d)) for d in (1, 2)})
    return [(m, *t) for m in block_ms for t in GROUPED_TILES], GROUPED_LAUNCH, moe.pick_config(pairs), make


def tune_router(tuner: Tuner, case: TuneCase, tokens: int, x: torch.Tensor) -> None:
    """The router in one launch (linear, softmax, top-k), beside cuBLAS's linear then route_topk."""
    from tokenspeed_kernels import moe

    shape = case.shape
    w = (torch.randn(shape.experts, shape.hidden, device=tuner.device) * shape.hidden**-0.5).to(x.dtype)
    # one copy a call, as many as fill the L2 twice over: each layer has its own router
    calls = 1 if tuner.smoke else min(256, -(-ROTATE_BYTES // (w.numel() * w.element_size())))
    ws = [w] + [w.clone() for _ in range(calls - 1)]
    tiles, launches, default, make = router_grid(tuner.smoke)

    def run(cfg: Any, i: int) -> Any:
        return moe.route_linear_topk(x, ws[i], shape.top_k, shape.renormalize, cfg)

    best = tuner.search(run, make, tiles, launches, calls, default)
    tuner.record("router", shape, shape.experts, shape.hidden, case.label, tokens, *best)
    unfused = tuner.time_us(lambda i: moe.route_topk(torch.nn.functional.linear(x, ws[i]), shape.top_k,
                                                     shape.renormalize), calls)  # fmt: skip
    tuner.configs[-1]["unfused_us"] = round(unfused, 2)
    print(f"{shape.name:>14} router tokens {tokens:>5}: linear then route_topk {unfused:9.1f} us", flush=True)


def tune_gemv(tuner: Tuner, case: TuneCase, tokens: int, x: torch.Tensor, flat: list[torch.Tensor],
              route: list[torch.Tensor]) -> tuple[Any, Any]:  # fmt: skip
    """The decode shape's two kernels: gate/up per pair, then down with the top-k sum (flat and route: the
    routings the calls rotate over)."""
    from tokenspeed_kernels import moe

    shape, label, w13, w2, s13, s2 = case.shape, case.label, case.w13, case.w2, case.s13, case.s2
    k = shape.top_k
    tiles, launches, default, make = gemv_grid(tuner.smoke)
    mid = moe.expert_gemv_up(x, w13, s13, flat[0], k, default)
    up = tuner.search(lambda c, i: moe.expert_gemv_up(x, w13, s13, flat[i], k, c), make, tiles, launches,
                      len(flat), default)  # fmt: skip
    tuner.record("gemv", shape, w13.shape[1], w13.shape[2], label, tokens, *up)
    def split(best: Any) -> list[Any]:  # the down kernel's pairs spread over 2 to k programs
        return [replace(best, pair_split=n) for n in range(2, k + 1) if k % n == 0 and n & (n - 1) == 0]

    tiles, launches, default, make = gemv_grid(tuner.smoke, down_splits(k))
    down = tuner.search(lambda c, i: moe.expert_gemv_down(mid, w2, s2, route[i], flat[i], k, c), make, tiles,
                        launches, len(flat), default, split)  # fmt: skip
    tuner.record("gemv", shape, w2.shape[1], w2.shape[2], label, tokens, *down)
    return up[0], down[0]


def tune_grouped(tuner: Tuner, case: TuneCase, tokens: int, x: torch.Tensor, flat: list[torch.Tensor],
                 route: list[torch.Tensor]) -> tuple[Any, Any]:  # fmt: skip
    """The grouped GEMMs (gate/up, then down), each over the pairs grouped with its own block_m: the row
    tiles tried are those near the pairs an expert gets on average."""
    from tokenspeed_kernels import moe

    shape, label, w13, w2, s13, s2 = case.shape, case.label, case.w13, case.w2, case.s13, case.s2
    e, k = shape.experts, shape.top_k
    tiles, launches, default, make = grouped_grid(tuner.smoke, shape, tokens)
    grouped: dict[tuple[int, int], Any] = {}  # (routing, block_m) -> the pairs sorted and padded

    def aligned(i: int, block_m: int) -> Any:
        if (i, block_m) not in grouped:
            grouped[i, block_m] = moe.moe_align(flat[i], e, block_m)
        return grouped[i, block_m]

    mid = moe.expert_gemm(x, w13, s13, route[0], *aligned(0, default.block_m), k, True, default)

    def gemm(a: torch.Tensor, w: torch.Tensor, s: Any, a_div: int, gated: bool) -> Any:
        def run(cfg: Any, i: int) -> Any:
            return moe.expert_gemm(a, w, s, route[i], *aligned(i, cfg.block_m), a_div, gated, cfg)

        # Beyond the coordinate search: every tile at 8 warps (large tiles need them, and the search only
        # varies the launch of the best 4-warp tile), and what the kept table picks now (the incumbent).
        incumbent = moe.pick_config(tokens * k, e, w.shape[1], w.shape[2], w.dtype, tokens)

        def more(best: Any) -> list[Any]:
            return [make(tile, (8, 3)) for tile in tiles] + [incumbent]

        best = tuner.search(run, make, tiles, launches, len(flat), default, more)
        tuner.record("grouped", shape, w.shape[1], w.shape[2], label, tokens, *best)
        incumbent_us = tuner.times.get(incumbent, float("nan"))
        tuner.configs[-1]["incumbent_us"] = round(incumbent_us, 2)
        print(f"  incumbent {incumbent}: {incumbent_us:9.1f} us", flush=True)
        return best[0]

    return gemm(x, w13, s13, k, True), gemm(mid, w2, s2, 1, False)


def compile_jobs(shapes: list[TuneShape], kinds: list[str], tokens: list[int], decode_max: int) -> list[tuple]:
    """What the searches' first phase will launch (the default and every tile at 4 warps, 3 stages), one
    job per kernel, configuration and specialization: the GEMVs' and the router's do not depend on the
    token count, the grouped GEMMs' do (the pair count is an argument Triton specializes on)."""
    from tokenspeed_kernels import moe

    jobs: list[tuple] = []
    for shape, kind in itertools.product(shapes, kinds):
        if min(tokens) <= decode_max:
            for proj, splits in (("up", (1,)), ("down", down_splits(shape.top_k))):
                tiles, _, default, make = gemv_grid(False, splits)
                jobs += [("gemv", proj, shape, kind, 1, cfg) for cfg in (default, *(make(t, (4, 3)) for t in tiles))]
        if kind != "fp8" and min(tokens) <= moe.ROUTER_FUSED_MAX_TOKENS:
            tiles, _, default, make = router_grid(False)
            jobs += [("router", "", shape, kind, 1, cfg) for cfg in (default, *(make(t, (4, 3)) for t in tiles))]
        seen: set[tuple] = set()
        for count in tokens:
            pairs = count * shape.top_k
            tiles, _, default, make = grouped_grid(False, shape, count)
            for proj, cfg in itertools.product(("up", "down"), (default, *(make(t, (4, 3)) for t in tiles))):
                key = (proj, cfg, pairs % 16 == 0, pairs == 1)
                if key not in seen:
                    seen.add(key)
                    jobs.append(("grouped", proj, shape, kind, count, cfg))
    return jobs


def compile_job(job: tuple) -> str | None:
    """Launch one job's kernel once on small stand-ins of its operands (two experts, zero weights: the
    same dtypes, strides and specializations), which compiles it into Triton's on-disk cache; the
    error, if any."""
    from tokenspeed_kernels import moe

    path, proj, shape, kind, tokens, cfg = job
    dev, act, k, h, inter = torch.device("cuda"), torch.bfloat16, shape.top_k, shape.hidden, shape.inter
    wdt = moe.FP8_DTYPE if kind == "fp8" else act
    try:
        if path == "router":
            moe.route_linear_topk(torch.zeros(tokens, h, dtype=act, device=dev),
                                  torch.zeros(shape.experts, h, dtype=act, device=dev), k, shape.renormalize, cfg)  # fmt: skip
            return None
        w13, w2 = torch.zeros(2, 2 * inter, h, dtype=wdt, device=dev), torch.zeros(2, h, inter, dtype=wdt, device=dev)
        s13, s2 = (torch.ones(2, 2 * inter, device=dev), torch.ones(2, h, device=dev)) if kind == "fp8" else (None, None)
        flat = torch.zeros(tokens * k, dtype=torch.int32, device=dev)
        route = torch.ones(tokens * k, device=dev)
        x, mid = torch.zeros(tokens, h, dtype=act, device=dev), torch.zeros(tokens * k, inter, dtype=act, device=dev)
        if path == "gemv":
            if proj == "up":
                moe.expert_gemv_up(x, w13, s13, flat, k, cfg)
            else:
                moe.expert_gemv_down(mid, w2, s2, route, flat, k, cfg)
        else:
            grouped = moe.moe_align(flat, 2, cfg.block_m)
            if proj == "up":
                moe.expert_gemm(x, w13, s13, route, *grouped, k, True, cfg)
            else:
                moe.expert_gemm(mid, w2, s2, route, *grouped, 1, False, cfg)
        torch.cuda.synchronize()
    except Exception as exc:  # a tile that does not fit: the search skips it too
        return f"{path} {proj} {cfg}: {type(exc).__name__}"
    return None


def precompile(jobs: list[tuple], workers: int) -> None:
    """compile_job over the jobs in worker processes (Triton compiles on the host, one kernel at a time a
    process): the searches then find every first-phase kernel compiled."""
    import concurrent.futures
    import multiprocessing

    t0 = time.monotonic()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [err for err in pool.map(compile_job, jobs, chunksize=4) if err]
    print(f"precompiled {len(jobs)} kernels in {workers} processes: {time.monotonic() - t0:.0f} s, {len(failed)} "
          f"failed to build {failed[:3]}", flush=True)  # fmt: skip


def next_power_of_2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def tune(args: argparse.Namespace) -> dict[str, Any]:
    """The fastest tile configuration per expert shape, weight kind and token count, against the default:
    the JSON kernels/moe_configs.json keeps (copy it there)."""
    if args.smoke:
        shapes = [TuneShape("smoke", 4, 2, 32, 24, True)]  # the interpreter is slow: 2 token counts, 1 shape
        device, decode_max = torch.device("cpu"), 2
        tokens = [int(t) for t in (args.tune_tokens or "1,3").split(",")]
    else:
        from transformers import AutoConfig

        from app.worker.models import model_class_for

        shapes = []
        for path in args.tune_models.split(","):
            config = AutoConfig.from_pretrained(path)
            spec = model_class_for(config).moe_spec(config)
            shapes.append(TuneShape(Path(path).name, spec.num_experts, spec.top_k, config.hidden_size,
                                    spec.intermediate, spec.renormalize))  # fmt: skip
        device, decode_max = torch.device("cuda"), 64
        tokens = [int(t) for t in (args.tune_tokens or ",".join(map(str, TUNE_TOKENS))).split(",")]
    tuner = Tuner(device, args.tune_budget, args.smoke)
    t0 = time.monotonic()
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke run)"

    kept = kept_rows({shape.name for shape in shapes}, set(tokens), set(args.tune_weights.split(","))) \
        if not args.smoke else {"configs": [], "choices": []}  # fmt: skip

    def table() -> dict[str, Any]:
        return {"source": f"python scripts/gpu/bench_moe.py --tune on {device_name}, {time.monotonic() - t0:.0f} s",
                "configs": tuner.configs + kept["configs"], "choices": tuner.choices + kept["choices"],
                "skipped": tuner.skipped}  # fmt: skip

    kinds = args.tune_weights.split(",")
    if not args.smoke and args.tune_jobs > 1:
        precompile(compile_jobs(shapes, kinds, tokens, decode_max), args.tune_jobs)
    cases = [make_case(tuner, shape, kind) for shape in shapes for kind in kinds]
    for count in tokens:  # the fewest tokens first: a budget run out skips the largest prefills
        for case in cases:
            if tuner.over():
                tuner.skipped.append(f"{case.shape.name} {case.label} tokens {count}")
            else:
                tune_case(tuner, case, count, decode_max)
        if args.json:  # what is measured so far, should the run be cut short
            write_json(args.json, table())
    return table()


def kept_rows(models: set[str], tokens: set[int], kinds: set[str]) -> dict[str, list]:
    """The kept table's rows this run does not measure again (--tune-models, --tune-tokens or
    --tune-weights a subset): they stay."""
    from tokenspeed_kernels import moe

    old = json.loads(moe.TABLE_PATH.read_text()) if moe.TABLE_PATH.exists() else {}

    def retuned(row: dict[str, Any]) -> bool:
        return row["model"] in models and row["tokens"] in tokens and row["weights"] in kinds

    return {key: [row for row in old.get(key, []) if not retuned(row)] for key in ("configs", "choices")}


def write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/models/qwen3-30b-a3b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-output-len", type=int, default=32)
    parser.add_argument("--quantizations", default="none,fp8", help="comma-separated: none, fp8")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--attention-backend", default=None, help="the runner's (default: its own choice)")
    parser.add_argument("--tune", action="store_true", help="time the MoE kernels' tile configurations instead")
    parser.add_argument("--tune-models", default=",".join(TUNE_MODELS), help="comma-separated model directories")
    parser.add_argument("--tune-weights", default="16,fp8", help="comma-separated: 16 (the model dtype), fp8")
    parser.add_argument("--tune-tokens", default=None, help="comma-separated token counts (default: every bucket)")
    parser.add_argument("--tune-budget", type=float, default=330.0, help="seconds; token counts past it skipped")
    parser.add_argument("--tune-jobs", type=int, default=12, help="processes compiling the kernels first (1: none)")
    parser.add_argument("--smoke", action="store_true", help="--tune on a tiny shape on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 in the environment")
    if args.tune:
        table = tune(args)
        print(f"{len(table['configs'])} configurations, {len(table['skipped'])} cases skipped: {table['skipped']}")
        if args.json:
            write_json(args.json, table)
        return
    dtype = getattr(torch, args.dtype)
    bandwidth = bench_latency.copy_bandwidth(torch.device(args.device)) if args.device.startswith("cuda") else None
    rows: dict[str, Any] = {"model": args.model, "copy_bandwidth_bytes_per_s": bandwidth}
    for name in args.quantizations.split(","):
        quantization = None if name == "none" else name
        result = runner_decode(args, quantization)
        result.update(active_bytes_per_token(args.model, dtype, quantization))
        if bandwidth:
            result["active_roofline_tokens_per_s"] = bandwidth / result["active_bytes_per_token"]
            result["ratio_to_active_roofline"] = result["decode_tokens_per_s"] / result["active_roofline_tokens_per_s"]
        rows[name] = result
    if "none" in rows and "fp8" in rows:
        rows["fp8_over_bf16"] = rows["fp8"]["decode_tokens_per_s"] / rows["none"]["decode_tokens_per_s"]
    if not args.skip_transformers:
        rows["transformers"] = transformers_decode(args)
    text = json.dumps(rows, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print("\n| run | decode tok/s (batch 1) | active GB / token | roofline tok/s | ratio |")
    print("|---|---|---|---|---|")
    for name in args.quantizations.split(","):
        r = rows[name]
        print(f"| {name} | {r['decode_tokens_per_s']:.1f} | {r['active_bytes_per_token'] / 1e9:.2f} | "
              f"{r.get('active_roofline_tokens_per_s') or float('nan'):.1f} | "
              f"{r.get('ratio_to_active_roofline') or float('nan'):.2f} |")  # fmt: skip
    if "transformers" in rows:
        print(f"| transformers generate | {rows['transformers']['decode_tokens_per_s']:.1f} | | | |")


if __name__ == "__main__":
    main()
