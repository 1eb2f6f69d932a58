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

--tune instead times the fused MoE kernels alone on one layer of the model's shape (random bf16 and FP8
experts, random routing) over a grid of tile configurations at several token counts, and prints the
fastest per shape beside the defaults kernels/moe.py picks: the table to keep in kernels/moe.py.
Then on the H200: pytest tests/gpu/test_moe_gpu.py (the kernels against float64, graphs equal eager).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
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


TUNE_TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)


def tune(args: argparse.Namespace) -> dict[str, Any]:
    """The fastest tile configuration of each expert shape per token count, against the default."""
    from tokenspeed_kernels.moe import (
        MoeConfig,
        MoeDecodeConfig,
        fused_moe,
        pick_config,
        pick_decode_config,
        route_topk,
        use_decode_shape,
    )
    from transformers import AutoConfig

    from app.worker.models import model_class_for
    from app.worker.quantization import quantize_rows

    config = AutoConfig.from_pretrained(args.model)
    spec = model_class_for(config).moe_spec(config)
    e, k, h, inter, dev = spec.num_experts, spec.top_k, config.hidden_size, spec.intermediate, torch.device("cuda")
    w13 = torch.randn(e, 2 * inter, h, device=dev) * h**-0.5
    w2 = torch.randn(e, h, inter, device=dev) * inter**-0.5
    (c13, s13), (c2, s2) = (quantize_rows(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
    weights = {"bf16": (w13.bfloat16(), w2.bfloat16(), None, None),
               "fp8": (c13.view(w13.shape), c2.view(w2.shape), s13.view(e, -1), s2.view(e, -1))}  # fmt: skip
    decode_grid = [MoeDecodeConfig(n, kk, warps, stages) for n in (4, 8, 16, 32) for kk in (128, 256, 512)
                   for warps in (2, 4, 8) for stages in (2, 3, 4)]  # fmt: skip
    grouped_grid = [MoeConfig(m, n, kk, warps, stages) for m in (16, 32, 64, 128) for n in (64, 128)
                    for kk in (64, 128) for warps in (4, 8) for stages in (3, 4)]  # fmt: skip
    table: dict[str, Any] = {}
    for name, (a, b, sa, sb) in weights.items():
        for tokens in TUNE_TOKENS:
            x = torch.randn(tokens, h, device=dev).bfloat16()
            route_w, ids = route_topk(torch.randn(tokens, e, device=dev), k, spec.renormalize)
            decode = use_decode_shape(tokens * k, e, k)
            grid = decode_grid if decode else grouped_grid
            default = pick_decode_config(inter, h) if decode else pick_config(tokens * k)

            def timed(cfg: Any) -> float:
                return bench_latency.median_cuda_ms(
                    lambda: fused_moe(x, a, b, route_w, ids, sa, sb, decode=decode, config=cfg), 20)  # noqa: B023

            times = {}
            for cfg in grid:
                try:
                    timed(cfg)  # compile
                    times[cfg] = timed(cfg)
                except Exception as exc:  # a tile that does not fit (shared memory, registers)
                    print(f"skip {cfg}: {type(exc).__name__}", file=sys.stderr)
            if default not in times:
                timed(default)  # compile
                times[default] = timed(default)
            best = min(times, key=times.get)
            table[f"{name} {tokens}"] = {"best": repr(best), "best_ms": times[best], "default": repr(default),
                                         "default_ms": times[default]}  # fmt: skip
            print(f"{name:>4} tokens {tokens:>5}: best {times[best] * 1e3:8.1f} us {best}; default "
                  f"{times[default] * 1e3:8.1f} us", flush=True)  # fmt: skip
    return table


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
    parser.add_argument("--tune", action="store_true", help="time the MoE kernels' tile configurations instead")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.tune:
        table = tune(args)
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=2) + "\n")
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
