"""Compile every Triton kernel of tokenspeed_kernels for the H200 (sm_90) and the A100 (sm_80), without a GPU.

Run as a script, or main() in a fresh process without TRITON_INTERPRET (tests/unit/test_kernels_compile.py
does, through check_in_compiler_process).
Triton's interpreter runs kernel bodies as Python, so the CPU tests cannot see what only the GPU
compiler rejects (a value retyped inside a runtime branch, a bad constexpr use); two such kernels
reached the GPU once. Here a stand-in driver reports the device and each launch only compiles
(Triton's warm-up path): the launchers run for real on CPU tensors, with the appliance's dtypes and the
GEMV's configurations, through ptxas. sm_90: everything, with programmatic dependent launch off and on
(tokenspeed_kernels.common.set_pdl); sm_80: all but the FP8 cases (FP8 needs sm_89), PDL off. Prints
the kernels compiled; exits 1 on a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton.runtime.jit as jit
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

FP8 = torch.float8_e4m3fn
HALF_TYPES = (torch.bfloat16, torch.float16)


class StandInDriver:
    """What compiling asks of the driver: a device, a stream and its target. Each capability is its own
    device number: Triton keeps a device's target with its compiled kernels."""

    def __init__(self, capability: int = 90) -> None:
        self.capability = capability

    def get_current_device(self) -> int:
        return self.capability

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


_run = jit.JITFunction.run


def cases() -> list[tuple[str, Callable[[], object]]]:
    from tokenspeed_kernels import (
        activation,
        decode_attention,
        fp8_quant,
        gemv,
        grammar_mask,
        greedy,
        kv_write,
        moe,
        page_table,
        prefill_attention,
        rmsnorm,
        rotary,
    )

    out: list[tuple[str, Callable[[], object]]] = []
    heads, kv_heads, dim, tokens, blocks, page = 8, 2, 128, 3, 6, 16
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.tensor([20, 33], dtype=torch.int32)
    for dtype in (*HALF_TYPES, torch.float32):
        x = torch.zeros(tokens, 256, dtype=dtype)
        w = torch.zeros(256, dtype=dtype)
        out.append((f"rms_norm {dtype}", lambda x=x, w=w: rmsnorm.rms_norm(x, w, 1e-6)))
        out.append((f"add_rms_norm {dtype}", lambda x=x, w=w: rmsnorm.add_rms_norm(x, x.clone(), w, 1e-6)))
        out.append((f"silu_and_mul {dtype}", lambda x=x: activation.silu_and_mul(x)))
        logits = torch.zeros(2, 5000, dtype=dtype)
        out.append((f"greedy_tokens {dtype}", lambda logits=logits: greedy.greedy_tokens(logits)))
        bitmask, rows = torch.zeros(1, 157, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        out.append((f"grammar apply_bitmask {dtype}",
                    lambda logits=logits, b=bitmask, r=rows: grammar_mask.apply_bitmask(logits, b, r)))
        out += fused_fp8_cases(dtype, rmsnorm, activation, fp8_quant)
        q = torch.zeros(tokens, heads, dim, dtype=dtype)
        k = torch.zeros(tokens, kv_heads, dim, dtype=dtype)
        cos = torch.zeros(64, dim // 2)
        pos = torch.zeros(tokens, dtype=torch.int64)
        out.append((f"rotary {dtype}", lambda q=q, k=k, cos=cos, pos=pos: rotary.rotary_inplace(q, k, cos, cos, pos)))
        many = rotary.ONE_HEAD_MAX_TOKENS + 1  # several heads a program
        qm, km, pm = (torch.zeros(many, *x.shape[1:], dtype=x.dtype) for x in (q, k, pos))
        out.append((f"rotary {dtype}, {many} tokens",
                    lambda q=qm, k=km, cos=cos, pos=pm: rotary.rotary_inplace(q, k, cos, cos, pos)))  # fmt: skip
        caches = [dtype, FP8] if dtype != torch.float32 else [dtype]
        for cache_dtype in caches:
            scale = 0.5 if cache_dtype == FP8 else 1.0
            kc = torch.zeros(blocks, page, kv_heads, dim).to(cache_dtype)
            out.append((f"write_kv {dtype} -> {cache_dtype}",
                        lambda k=k, kc=kc, pos=pos, s=scale: kv_write.write_kv(k, k, kc, kc.clone(), pos, s, s)))
            out.append((f"rotate_and_write_kv {dtype} -> {cache_dtype}",
                        lambda q=q, k=k, kc=kc, cos=cos, pos=pos, s=scale: rotary.rotate_and_write_kv(
                            q, k, k.clone(), cos, cos, pos, kc, kc.clone(), pos, s, s)))  # fmt: skip
            out.append((f"rotate_and_write_kv {dtype} -> {cache_dtype}, q/k norms",
                        lambda q=q, k=k, kc=kc, cos=cos, pos=pos, s=scale: rotary.rotate_and_write_kv(
                            q, k, k.clone(), cos, cos, pos, kc, kc.clone(), pos, s, s,
                            qk_norm=rotary.QKNorm(q[0, 0].clone(), q[0, 0].clone(), 1e-6))))  # fmt: skip
            out.append((f"rotate_and_write_kv {dtype} -> {cache_dtype}, q_out",
                        lambda q=q, k=k, kc=kc, cos=cos, pos=pos, s=scale: rotary.rotate_and_write_kv(
                            q, k, k.clone(), cos, cos, pos, kc, kc.clone(), pos, s, s, q_out=q.clone())))  # fmt: skip
            out.append((f"rotate_and_write_kv {dtype} -> {cache_dtype}, {many} tokens",
                        lambda q=qm, k=km, kc=kc, cos=cos, pos=pm, s=scale: rotary.rotate_and_write_kv(
                            q, k, k.clone(), cos, cos, pos, kc, kc.clone(), pos, s, s)))  # fmt: skip
            dq = torch.zeros(2, heads, dim, dtype=dtype)
            for splits in (3, 1):  # one piece: an FP8 cache's longer tile
                out.append((f"decode_attention {dtype} / {cache_dtype}, {splits} pieces",
                            lambda dq=dq, kc=kc, s=scale, n=splits: decode_attention.paged_decode_attention(
                                dq, kc, kc.clone(), table, lens, 0.1, n, k_scale=s, v_scale=s)))  # fmt: skip
            cu = torch.tensor([0, 1, 3], dtype=torch.int32)
            out.append((f"prefill_attention {dtype} / {cache_dtype}",
                        lambda q=q, kc=kc, cu=cu, s=scale: prefill_attention.paged_prefill_attention(
                            q, kc, kc.clone(), table, cu, lens, 2, 0.1, k_scale=s, v_scale=s)))  # fmt: skip
        out.append((f"quantize_rows {dtype} -> float8", lambda x=x: fp8_quant.quantize_rows(x)))
        out.append((f"cast_to_e4m3 {dtype} -> float8", lambda q=q: fp8_quant.cast_to_e4m3(q)))
    indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    out.append(("flatten_block_tables", lambda: page_table.flatten_block_tables(table, indptr, 5)))
    out += gemv_cases(gemv)
    return out + moe_cases(moe)


def moe_cases(moe) -> list[tuple[str, Callable[[], object]]]:  # noqa: ANN001
    """The router (alone and with its linear), the grouping of pairs by expert, and both expert shapes (per-pair
    GEMV, grouped GEMM) with 16-bit and FP8 weights."""
    out = []
    e, k, h, inter, tokens = 16, 4, 256, 96, 3
    for dtype in (*HALF_TYPES, torch.float32):
        logits = torch.zeros(tokens, e, dtype=dtype)
        out.append((f"route_topk {dtype}", lambda logits=logits: moe.route_topk(logits, k, True)))
        x, router = torch.zeros(tokens, h, dtype=dtype), torch.zeros(e, h, dtype=dtype)
        out.append((f"route_linear_topk {dtype}", lambda x=x, w=router: moe.route_linear_topk(x, w, k, True)))
    weights, ids = torch.ones(tokens, k), torch.zeros(tokens, k, dtype=torch.int32)
    flat = torch.zeros(600, 1, dtype=torch.int32)
    out.append(("moe_align", lambda f=flat: moe.align_in_chunks(f, 128, 16)))
    for w_dtype in (*HALF_TYPES, FP8):
        w13, w2 = torch.zeros(e, 2 * inter, h).to(w_dtype), torch.zeros(e, h, inter).to(w_dtype)
        scales = (torch.ones(e, 2 * inter), torch.ones(e, h)) if w_dtype == FP8 else (None, None)
        for x_dtype in HALF_TYPES if w_dtype == FP8 else (w_dtype,):  # 16-bit experts are in the model dtype
            x = torch.zeros(tokens, h, dtype=x_dtype)
            name = "float8" if w_dtype == FP8 else str(w_dtype)
            for decode in (True, False):
                out.append((f"fused_moe {name} x {x_dtype} {'decode' if decode else 'grouped'}",
                            lambda x=x, w13=w13, w2=w2, s=scales, d=decode: moe.fused_moe(
                                x, w13, w2, weights, ids, *s, decode=d)))  # fmt: skip
            dot = moe.MoeDecodeConfig(block_n=16, block_k=64, use_dot=True, pair_split=2)  # down: k over 2
            out.append((f"fused_moe {name} x {x_dtype} decode on tensor cores, pairs split",
                        lambda x=x, w13=w13, w2=w2, s=scales, c=dot: moe.fused_moe(
                            x, w13, w2, weights, ids, *s, decode=True, config=c)))  # fmt: skip
    return out


def fused_fp8_cases(  # noqa: ANN001
    dtype: torch.dtype, rmsnorm, activation, fp8_quant
) -> list[tuple[str, Callable[[], object]]]:
    """The kernels that write per-row FP8 codes: rows held in registers, and (wider than
    fp8_quant.MAX_ROW_IN_REGISTERS) the two-pass loop."""
    wide = fp8_quant.MAX_ROW_IN_REGISTERS + 16
    x, xw = torch.zeros(3, 256, dtype=dtype), torch.zeros(3, 2 * wide, dtype=dtype)
    w = torch.zeros(256, dtype=dtype)
    return [
        (f"rms_norm_fp8 {dtype} -> float8", lambda: rmsnorm.rms_norm_fp8(x, w, 1e-6)),
        (f"add_rms_norm_fp8 {dtype} -> float8", lambda: rmsnorm.add_rms_norm_fp8(x, x.clone(), w, 1e-6)),
        (f"silu_and_mul_fp8 {dtype} -> float8", lambda: activation.silu_and_mul_fp8(x)),
        (f"silu_and_mul_fp8 {dtype} -> float8, rows of {wide}", lambda: one_program_a_row(activation, xw)),
        (f"silu_and_mul_fp8 {dtype} -> float8, spread over programs", lambda: activation.silu_and_mul_fp8(xw)),
        (f"quantize_rows {dtype} -> float8, rows of {wide}", lambda: fp8_quant.quantize_rows(xw[:, :wide])),
    ]


def one_program_a_row(activation, x: torch.Tensor) -> object:  # noqa: ANN001
    """silu_and_mul_fp8 one program a row, however few the rows (else spread over programs)."""
    saved, activation.SPREAD_MAX_ROWS = activation.SPREAD_MAX_ROWS, 0
    try:
        return activation.silu_and_mul_fp8(x)
    finally:
        activation.SPREAD_MAX_ROWS = saved


def gemv_cases(gemv) -> list[tuple[str, Callable[[], object]]]:  # noqa: ANN001
    """Every configuration the GEMV can pick: the measured table's and the defaults, per row bucket."""
    out = []
    n, k = 512, 1024
    for weight_dtype in (*HALF_TYPES, FP8):
        w = torch.zeros(n, k).to(weight_dtype)
        scale = torch.ones(n) if weight_dtype == FP8 else None
        configs = {gemv.pick_config(m, n, k, weight_dtype) for m in gemv.ROW_BUCKETS}
        family = "fp8" if weight_dtype == FP8 else "16"
        configs |= {c for (f, *_), c in gemv._MEASURED.items() if f == family}
        for x_dtype in HALF_TYPES:
            for config in configs:
                for m in gemv.ROW_BUCKETS:
                    if config.problem(m, weight_dtype, x_dtype) is None:
                        x = torch.zeros(m, k, dtype=x_dtype)
                        out.append((f"gemv {weight_dtype} x {x_dtype} m={m} {config}",
                                    lambda x=x, w=w, s=scale, c=config: gemv.gemv(x, w, s, c)))  # fmt: skip
                        break  # one row count a configuration: BLOCK_M is all that varies (FMA: 1 to 4)
    return out + w8a8_gemv_cases(gemv)


def w8a8_gemv_cases(gemv) -> list[tuple[str, Callable[[], object]]]:  # noqa: ANN001
    """x as FP8 codes too: the W8A8 table's and default configurations."""
    n, k = 512, 1024
    w, scale = torch.zeros(n, k).to(FP8), torch.ones(n)
    configs = {gemv.pick_config(m, n, k, FP8, fp8_x=True) for m in gemv.ROW_BUCKETS}
    configs |= {c for (f, *_), c in gemv._MEASURED.items() if f == "w8a8"}
    x, x_scale = torch.zeros(1, k).to(FP8), torch.ones(1, 1)
    return [(f"gemv {FP8} x {FP8} {config}",
             lambda c=config: gemv.gemv(x, w, scale, c, x_scale, torch.bfloat16)) for config in configs]  # fmt: skip


def compile_for(capability: int, launch: Callable[[], object]) -> list:
    """The kernels launch() starts, compiled (not run) for sm_{capability} through the stand-in driver: each
    one's compiled form (its .asm["ttgir"] for what the compiler made of it). For a fresh process without
    TRITON_INTERPRET: it leaves launches compiling only."""
    kernels = []

    def compile_only(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        kernels.append(_run(self, *args, grid=grid, warmup=True, **kwargs))
        return kernels[-1]

    jit.JITFunction.run = compile_only
    driver.set_active(StandInDriver(capability))
    launch()
    return kernels


def unpipelined_loop(kernel) -> str | None:  # noqa: ANN001
    """What keeps a compiled kernel's first loop from streaming (None: nothing): on sm_90 the pipeliner
    turns the loads it requests stages ahead into asynchronous copies; a plain load in the loop waits."""
    ttgir = kernel.asm["ttgir"]
    start = ttgir.index("scf.for")
    body = ttgir[start : ttgir.index("scf.yield", start)]
    synchronous, asynchronous = len(re.findall(r"= tt\.load ", body)), body.count("async_copy_global_to_local")
    if synchronous or not asynchronous:
        return f"{synchronous} synchronous loads and {asynchronous} asynchronous copies in its loop"
    return None


def count_unpipelined(cases: list[tuple[str, Callable[[], object]]]) -> int:
    """For a fresh process (check_in_compiler_process): compiles each case's one kernel for sm_90 with PDL
    on, prints the label and the problem of each whose loop does not stream (unpipelined_loop), and
    returns how many."""
    from tokenspeed_kernels.common import set_pdl

    set_pdl(True)
    failures = 0
    for label, launch in cases:
        (kernel,) = compile_for(90, launch)
        problem = unpipelined_loop(kernel)
        if problem:
            failures += 1
            print(f"{label}: {problem}")
    return failures


def check_in_compiler_process(function: str, timeout: float = 300) -> str:
    """Call function ("module:name", returning a count of failures as its exit status) in a fresh Python
    without TRITON_INTERPRET, where compile_for compiles for real; assert it found none. Its output."""
    module, name = function.split(":")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import sys; from {module} import {name}; sys.exit({name}())"
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=repo)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def main() -> int:
    from tokenspeed_kernels.common import set_pdl

    failures, compiled = 0, set()
    for capability, pdl in ((90, False), (90, True), (80, False)):
        set_pdl(pdl)
        for name, launch in cases():
            if capability < 89 and "float8" in name:
                continue
            try:
                compiled.update(kernel.name for kernel in compile_for(capability, launch))
            except Exception:
                failures += 1
                print(f"FAILED {name} (sm_{capability}, PDL {pdl})\n{traceback.format_exc(limit=-3)}",
                      file=sys.stderr)  # fmt: skip
    print("compiled:", " ".join(sorted(compiled)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
