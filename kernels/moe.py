"""Mixture-of-experts kernels: the router (softmax and top-k in one kernel) and the fused expert MLP.

Router: logits [T, E] -> routing weights [T, k] float32 and expert ids [T, k] int32. Softmax in float32
over all E experts, then the k largest (the lowest expert id first among equal probabilities, so ties are
deterministic), renormalised to sum to one where the model says (Mixtral, Qwen3-MoE's norm_topk_prob).
For a few tokens (decode steps) the router's linear runs in the same launch (route_linear_topk): programs
over slices of the experts compute the logits, and each token's last to finish picks its experts.

Experts: w13 [E, 2I, H] holds each expert's gate rows then its up rows, w2 [E, H, I] its down projection;
16-bit, or FP8 e4m3 codes with per-output-channel float32 scales ([E, 2I] and [E, H]). The T*k
(token, expert) pairs are multiplied in two shapes of kernel:
- Grouped (prefills): `moe_align` sorts the pairs by expert and pads each expert's group to BLOCK_M rows
  with static sizes (no host sync: the step can be captured in a CUDA graph; two launches over chunks of
  pairs up to ALIGN_MAX_PAIRS), then one grouped GEMM per
  projection, each program taking BLOCK_M rows of one expert and a BLOCK_N slice of its outputs. The
  first reads the expert's gate and up rows together and writes SiLU(gate) * up per pair; the second
  multiplies the routing weight in.
- Decode (a few pairs): a GEMV in float32 registers reading only the weights of the experts the pairs
  picked, no sort, no padding: gate/up one program per pair and BLOCK_N slice; down one program per
  token and BLOCK_N slice, looping over the token's k pairs, so that the top-k weighted sum is taken
  there in a fixed order (deterministic, unlike atomic adds into the output): two launches in all.
The grouped shape sums a token's k weighted outputs in one more launch. Under programmatic dependent
launch (common.set_pdl) each kernel waits for the one before it first, as the other decode-path kernels
do. Tiles: the table bench_moe.py --tune measured on the H200 (moe_configs.json beside this file, keyed
by path, experts, the weight's N and K, 16-bit or FP8, token bucket), else the defaults below.
FP8 codes are converted to the activation dtype in registers (exact) and
the per-channel scales multiply the float32 sums.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import (
    FP8_DTYPE,
    INTERPRETING,
    arrival_counts,
    dot_precision,
    last_to_arrive,
    next_power_of_2,
    pdl_options,
    wait_for_predecessor,
)

# The per-pair GEMV reads an expert once per pair that chose it, the grouped GEMM once per expert. While the
# pairs are at most half the experts most of them pick distinct experts, so the two read about the same and
# the GEMV saves the sort and the padded tiles; up to this many pairs at most (Qwen3-30B-A3B: batch 8).
DECODE_MAX_PAIRS = 64


def use_decode_shape(pairs: int, num_experts: int, top_k: int) -> bool:
    return pairs <= min(DECODE_MAX_PAIRS, max(top_k, num_experts // 2))
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_DTYPE)


# ---------------------------------------------------------------- router


@triton.jit
def _softmax_topk(x, cols, ok, out, weights_ptr, ids_ptr, E, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One token's logits x [BLOCK_E] (float32; the ok ones real) -> its top-k weights and ids, stored at
    out..out + TOP_K."""
    x = tl.where(ok, x, -float("inf"))
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(ok, p, 0.0)
    p = p / tl.sum(p, 0)
    # One int64 key an expert, so that a pick is one max: the probability's bits above (non-negative floats
    # order as their bits do; the padding's -1.0 is below them all), E - 1 - id below (the lowest id first
    # among equal probabilities). A NaN row's keys tie above the padding: it still names real experts, and
    # its NaN weights poison only its own token, never an out-of-range read.
    bits = tl.where(ok, p, -1.0).to(tl.int32, bitcast=True).to(tl.int64)
    keys = (bits << 32) | tl.where(ok, E - 1 - cols, 0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(keys, 0)
        high = best >> 32
        top_w = tl.where(kk == i, high.to(tl.int32).to(tl.float32, bitcast=True), top_w)
        top_id = tl.where(kk == i, (E - 1 - (best - (high << 32))).to(tl.int32), top_id)
        keys = tl.where(keys == best, -(1 << 62), keys)  # picked: below every other key
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + out + kk, top_w, mask=kk < TOP_K)
    tl.store(ids_ptr + out + kk, top_id, mask=kk < TOP_K)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    wait_for_predecessor(USE_PDL)  # the router's logits
    ok = cols < E
    x = tl.load(logits_ptr + row * stride_t + cols, mask=ok, other=0.0).to(tl.float32)
    _softmax_topk(x, cols, ok, row * TOP_K, weights_ptr, ids_ptr, E, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, arrivals_ptr, E, H, stride_x, stride_w, SLICES,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SLICE_E: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The router linear and its softmax and top-k in one launch: each program computes SLICE_E logits of
    one token (a GEMV in float32 registers, rounded to the activations' dtype as the linear's output is),
    and the token's last program to finish picks its experts from all of them."""
    row = tl.program_id(0)
    pid_e = tl.program_id(1)
    wait_for_predecessor(USE_PDL)  # the normed rows
    re = pid_e * SLICE_E + tl.arange(0, SLICE_E)
    e_ok = re < E
    rh = tl.arange(0, BLOCK_H)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    w_rows = w_ptr + re[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((SLICE_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + rh
        h_ok = hh < H
        a = tl.load(x_row + hh, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w_rows + hh[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32) * a
    logits = logits_ptr + row * E
    tl.store(logits + re, tl.sum(acc, 1).to(logits_ptr.dtype.element_ty), mask=e_ok)
    if last_to_arrive(arrivals_ptr + row, SLICES):
        cols = tl.arange(0, BLOCK_E)
        ok = cols < E
        x = tl.load(logits + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        _softmax_topk(x, cols, ok, row * TOP_K, weights_ptr, ids_ptr, E, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, top_k] float32, expert ids [T, top_k] int32)."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in 1..{e} (the experts), got {top_k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
                            BLOCK_E=next_power_of_2(e), BLOCK_K=next_power_of_2(top_k), **pdl_options())  # fmt: skip
    return weights, ids


# The router in one launch (route_linear_topk) up to this many tokens, the decode steps': larger batches
# take the linear (cuBLAS) and then route_topk.
ROUTER_FUSED_MAX_TOKENS = 16


@dataclass(frozen=True)
class RouterConfig:
    slice_e: int = 8  # logits a program: Qwen3-30B-A3B's 128 experts over 16 programs a token
    block_h: int = 256
    num_warps: int = 4


def route_linear_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                      config: RouterConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [T, H] and the router's weight [E, H] (same dtype) -> route_topk(x @ weight.T) in one launch:
    (weights [T, top_k] float32, expert ids [T, top_k] int32)."""
    t, h = x.shape
    e = weight.shape[0]
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in 1..{e} (the experts), got {top_k}")
    if tuple(weight.shape) != (e, h) or weight.dtype != x.dtype:
        raise ValueError(f"the router weight must be [E, {h}] in {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if INTERPRETING:
        cfg = config or RouterConfig(slice_e=4, block_h=32)
    else:
        cfg = config or measured("router", e, e, h, x.dtype, t) or RouterConfig()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    if t:
        slices = triton.cdiv(e, cfg.slice_e)
        logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
        _router_kernel[(t, slices)](
            x, weight, logits, weights, ids, arrival_counts(x.device, t), e, h, x.stride(0), weight.stride(0), slices,
            TOP_K=top_k, RENORMALIZE=renormalize, SLICE_E=cfg.slice_e, BLOCK_H=cfg.block_h, BLOCK_E=next_power_of_2(e),
            BLOCK_K=next_power_of_2(top_k), num_warps=cfg.num_warps, **pdl_options(),
        )  # fmt: skip
    return weights, ids


def route_topk_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch: a stable descending sort keeps the lowest id first among equal probabilities."""
    p = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# ---------------------------------------------------------------- grouping pairs by expert


# moe_align's chunk of pairs a program: each program sorts its chunk in registers. The kernels run up to
# ALIGN_MAX_PAIRS pairs (a decode step of 2,048 tokens at top-8), the torch version beyond: one program
# turns every chunk's counts into offsets one chunk after another, which at a prefill's 131,072 pairs
# (512 chunks) is no longer cheap.
ALIGN_CHUNK = 256
ALIGN_MAX_PAIRS = 64 * ALIGN_CHUNK


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted pair ids [blocks * block_m], expert of each block [blocks]). Pair p is token
    p // k's choice p % k. Each expert's pairs are contiguous, in pair order, and its group padded to
    block_m rows with the pair count T*k (a row the kernels skip); blocks past the last group have expert
    -1. The sizes depend on T, k and E only: at most one non-empty block per pair, and at most one padded
    block per expert. Two launches over chunks of ALIGN_CHUNK pairs (_align_count_kernel, then
    _align_place_kernel) up to ALIGN_MAX_PAIRS pairs, else moe_align_reference (torch)."""
    if not (ids.is_cuda or INTERPRETING) or not 0 < ids.numel() <= ALIGN_MAX_PAIRS:
        return moe_align_reference(ids, num_experts, block_m)
    return align_in_chunks(ids, num_experts, block_m)


def align_in_chunks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's kernels (1 to ALIGN_MAX_PAIRS pairs)."""
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    pairs = flat.numel()
    blocks = min(pairs, triton.cdiv(pairs, block_m) + num_experts)
    chunks = triton.cdiv(pairs, ALIGN_CHUNK)
    bins = next_power_of_2(num_experts + 1)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    # a row a chunk (its counts, then the running counts before it), then each expert's padded start
    before = torch.empty(chunks + 1, bins, dtype=torch.int32, device=ids.device)
    common = dict(BLOCK_M=block_m, CHUNK=ALIGN_CHUNK, BINS=bins, num_warps=4, **pdl_options())
    _align_count_kernel[(chunks,)](flat, sorted_ids, block_expert, before, arrival_counts(ids.device, 1), pairs,
                                   num_experts, blocks, chunks, **common)  # fmt: skip
    _align_place_kernel[(chunks,)](flat, sorted_ids, before, pairs, num_experts, chunks, **common)
    return sorted_ids, block_expert


@triton.jit
def _chunk_ids(ids_ptr, c, P, E, CHUNK: tl.constexpr):
    """Chunk c's expert ids (E past the last pair: a bin no expert has) and their positions in it."""
    i = tl.arange(0, CHUNK)
    return tl.load(ids_ptr + c * CHUNK + i, mask=c * CHUNK + i < P, other=E), i


@triton.jit
def _align_count_kernel(ids_ptr, sorted_ptr, block_expert_ptr, before_ptr, arrivals_ptr, P, E, BLOCKS, CHUNKS,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr,
                        USE_PDL: tl.constexpr):  # fmt: skip
    """Program c counts chunk c's pairs by expert and pads its share of the rows. The last to finish turns
    the counts into the chunks' running counts before them, stores each expert's padded start after
    them (row CHUNKS) and writes every block's expert."""
    c = tl.program_id(0)
    wait_for_predecessor(USE_PDL)  # the expert ids (and no store before it: the outputs are fresh memory)
    rows = BLOCKS * BLOCK_M
    share = tl.cdiv(rows, CHUNKS)
    for r0 in range(c * share, tl.minimum(rows, (c + 1) * share), CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + r, tl.full((CHUNK,), 0, tl.int32) + P, mask=(r < rows) & (r < (c + 1) * share))
    ex, _ = _chunk_ids(ids_ptr, c, P, E, CHUNK)
    bins = tl.arange(0, BINS)
    tl.store(before_ptr + c * BINS + bins, tl.histogram(ex, BINS))
    if last_to_arrive(arrivals_ptr, CHUNKS):
        running = tl.zeros((BINS,), dtype=tl.int32)
        for cc in range(CHUNKS):  # the counts -> the chunks' running sums before them
            counts = tl.load(before_ptr + cc * BINS + bins, cache_modifier=".cg")
            tl.store(before_ptr + cc * BINS + bins, running)
            running += counts
        counts = tl.where(bins < E, running, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        tl.store(before_ptr + CHUNKS * BINS + bins, ends - padded)
        # block b's expert: how many groups end at or before its first row (E for the blocks past them all)
        for b0 in range(0, BLOCKS, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            done = tl.sum(((ends[None, :] <= (b * BLOCK_M)[:, None]) & (bins[None, :] < E)).to(tl.int32), 1)
            tl.store(block_expert_ptr + b, tl.where(done < E, done, -1), mask=b < BLOCKS)


@triton.jit
def _align_place_kernel(ids_ptr, sorted_ptr, before_ptr, P, E, CHUNKS, BLOCK_M: tl.constexpr,
                        CHUNK: tl.constexpr, BINS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """Program c writes chunk c's pair ids to their rows: its chunk sorted by (expert, pair) in registers,
    each pair at its expert's padded start, plus the expert's pairs in the chunks before, plus its rank
    among the chunk's pairs of that expert."""
    c = tl.program_id(0)
    wait_for_predecessor(USE_PDL)  # the offsets
    ex, i = _chunk_ids(ids_ptr, c, P, E, CHUNK)
    key = tl.sort(ex * CHUNK + i)  # by expert, then by pair: a stable order
    ex_s = key // CHUNK
    counts = tl.histogram(ex, BINS)
    ok = ex_s < E
    at = tl.where(ok, ex_s, 0)
    start = tl.load(before_ptr + c * BINS + at, mask=ok, other=0) + tl.load(before_ptr + CHUNKS * BINS + at,
                                                                            mask=ok, other=0)  # fmt: skip
    dest = start + i - tl.gather(tl.cumsum(counts, 0) - counts, at, 0)
    tl.store(sorted_ptr + tl.where(ok, dest, 0), c * CHUNK + key % CHUNK, mask=ok)


def moe_align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align in torch (static sizes too, so capturable; about 25 small kernels)."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    blocks = min(pairs, triton.cdiv(pairs, block_m) + num_experts)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert_of]
    sorted_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


# ---------------------------------------------------------------- expert GEMMs


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 64  # grouped: rows (pairs) of one expert a program
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeDecodeConfig:
    # Defaults near the FMA shape kernels/gemv.py measured fastest for one row (8 x 1024 over 4096-wide
    # rows); the experts' rows are 768 to 2048 wide. Not tuned on these shapes yet (bench_moe.py --tune).
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False  # tensor-core tiles of DOT_ROWS rows (block_n and block_k at least 16)
    pair_split: int = 1  # down: programs a token's k pairs are spread over (a divisor of k; else 1)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, c_ptr, route_ptr, sorted_ids_ptr, block_expert_ptr,
    N, K, PAIRS, stride_am, stride_we, stride_wn, stride_se, stride_cm,
    A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_ROUTE: tl.constexpr, HAS_SCALE: tl.constexpr,
    F16_OPERANDS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """c[pair, n] for BLOCK_M pairs of one expert: a's row pair // A_DIV times the expert's rows n (and,
    GATED, n + N: SiLU(gate) * up), times the pair's routing weight with MUL_ROUTE. F16_OPERANDS: bfloat16
    rows times FP8 codes, both as float16 (see _as_f16)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    wait_for_predecessor(USE_PDL)  # the grouping and the activations come from the kernels before
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = pairs < PAIRS
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + (pairs // A_DIV).to(tl.int64)[:, None] * stride_am
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = _as_f16(tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0), F16_OPERANDS)
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0).to(a.dtype)
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
            if GATED:
                up = tl.load(w_rows + N * stride_wn + kk[None, :], mask=w_mask, other=0.0).to(a.dtype)
                acc_up += tl.dot(a, tl.trans(up), input_precision=PRECISION)
        if F16_OPERANDS:  # the rows' 2^-8 back
            acc *= 256.0
            acc_up *= 256.0
        out = _epilogue(acc, acc_up, scale_ptr + expert.to(tl.int64) * stride_se, rn, n_ok, N, GATED, HAS_SCALE)
        if MUL_ROUTE:
            out = out * tl.load(route_ptr + pairs, mask=m_ok, other=0.0)[:, None]
        c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c, out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _epilogue(acc, acc_up, scales, rn, n_ok, N, GATED: tl.constexpr, HAS_SCALE: tl.constexpr):
    """The per-channel scales of FP8 codes, then SiLU(gate) * up for the gated projection."""
    if HAS_SCALE:
        acc = acc * tl.load(scales + rn, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scales + N + rn, mask=n_ok, other=0.0)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    return acc


@triton.jit
def _as_f16(a, F16_OPERANDS: tl.constexpr):
    """Rows for products with FP8 codes: with F16_OPERANDS bfloat16 rows go to float16 scaled by 2^-8, which
    keeps their 8 bits for magnitudes from 2^-6 to 2^24 (smaller ones to 2^-16 absolute), and the codes
    follow them to float16 exactly; the caller multiplies the float32 sums by 2^8. On the H200 a code
    converts to float16 in one instruction a pair, to bfloat16 in several: the FP8 GEMMs were bound by
    those casts."""
    if F16_OPERANDS:
        a = (a.to(tl.float32) * 0.00390625).to(tl.float16)
    return a


# The tensor-core form of the decode GEMVs multiplies a tile of DOT_ROWS rows, the pair's row and zeros
# (tl.dot's smallest M): the weights are read once either way, and the FMA form's per-element converts
# and multiply-adds (FP8 codes: two converts an element) leave the ALUs.
DOT_ROWS = tl.constexpr(16)


@triton.jit
def _row_times_rows(a_row, w_rows, N_OFFSET, K, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    USE_DOT: tl.constexpr, F16_OPERANDS: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """The dot products of one activation row (a_row: its pointer) with the weight rows w_rows + N_OFFSET
    (BLOCK_N of them, the n_ok ones real), over K, in float32: [BLOCK_N]. F16_OPERANDS (tensor-core tiles
    only): as float16 (see _as_f16)."""
    rk = tl.arange(0, BLOCK_K)
    if USE_DOT:
        rows = tl.arange(0, DOT_ROWS)
        acc = tl.zeros((DOT_ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(a_row + rows[:, None] * 0 + kk[None, :], mask=(rows[:, None] == 0) & k_ok[None, :], other=0.0)
            a = _as_f16(a, F16_OPERANDS)
            w = tl.load(w_rows + N_OFFSET + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(a.dtype)
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
        if F16_OPERANDS:
            acc *= 256.0
        return tl.sum(acc, 0)  # rows past the first are zero
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(a_row + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_rows + N_OFFSET + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a
        return tl.sum(acc, 1)


@triton.jit
def _moe_gemv_kernel(
    a_ptr, w_ptr, scale_ptr, c_ptr, ids_ptr, N, K, stride_am, stride_we, stride_wn, stride_se, stride_cm,
    A_DIV: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, F16_OPERANDS: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The decode shape's gate and up: mid[pair, n] = SiLU(gate) * up for one pair and BLOCK_N outputs,
    products in float32 (registers, or tensor-core tiles with USE_DOT)."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    wait_for_predecessor(USE_PDL)  # the expert ids and the activations come from the kernels before
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    a_row = a_ptr + (pair // A_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn
    gate = _row_times_rows(a_row, w_rows, 0, K, n_ok, BLOCK_N, BLOCK_K, USE_DOT, F16_OPERANDS, PRECISION)
    up = _row_times_rows(a_row, w_rows, N * stride_wn, K, n_ok, BLOCK_N, BLOCK_K, USE_DOT, F16_OPERANDS, PRECISION)
    # [1, BLOCK_N] rows so that the epilogue's broadcasts are the grouped kernel's
    out = _epilogue(gate[None, :], up[None, :], scale_ptr + expert * stride_se, rn, n_ok, N, True, HAS_SCALE)
    tl.store(c_ptr + pair.to(tl.int64) * stride_cm + rn[None, :], out.to(c_ptr.dtype.element_ty),
             mask=n_ok[None, :])  # fmt: skip


@triton.jit
def _moe_down_sum_kernel(
    a_ptr, w_ptr, scale_ptr, c_ptr, route_ptr, ids_ptr, parts_ptr, arrivals_ptr, N, K, stride_am, stride_we,
    stride_wn, stride_se, stride_cm, TOP_K: tl.constexpr, PAIR_SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, F16_OPERANDS: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The decode shape's down projection with the top-k sum folded in: out[token, n] for one token and
    BLOCK_N outputs, the sum over its k pairs of weight * (down rows of the pair's expert) . mid[pair],
    in float32 and in a fixed order (deterministic, unlike atomic adds). With PAIR_SPLIT > 1 the token's
    pairs are spread over that many programs (more loads in flight for a few tokens): each stores its
    partial sum, and the last of them to finish adds the partials in split order."""
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    wait_for_predecessor(USE_PDL)  # mid and the routing come from the kernels before
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for jj in range(TOP_K // PAIR_SPLIT):
        pair = token * TOP_K + split * (TOP_K // PAIR_SPLIT) + jj
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_row = a_ptr + pair.to(tl.int64) * stride_am
        w_rows = w_ptr + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn
        part = _row_times_rows(a_row, w_rows, 0, K, n_ok, BLOCK_N, BLOCK_K, USE_DOT, F16_OPERANDS, PRECISION)
        if HAS_SCALE:
            part = part * tl.load(scale_ptr + expert * stride_se + rn, mask=n_ok, other=0.0)
        total += part * tl.load(route_ptr + pair)
    out = c_ptr + token.to(tl.int64) * stride_cm + rn
    if PAIR_SPLIT == 1:
        tl.store(out, total.to(c_ptr.dtype.element_ty), mask=n_ok)
    else:
        parts = parts_ptr + token.to(tl.int64) * PAIR_SPLIT * N + rn  # [T, PAIR_SPLIT, N] float32
        tl.store(parts + split * N, total, mask=n_ok)
        if last_to_arrive(arrivals_ptr + token * tl.num_programs(1) + pid_n, PAIR_SPLIT):
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sp in range(PAIR_SPLIT):
                total += tl.load(parts + sp * N, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(c_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------- configurations

# Token counts the kept table is measured at: a count takes the configuration of the next bucket up. The
# largest are a chunked prefill's (16,384 tokens a step by default where MoE models serve many sequences).
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TABLE_PATH = Path(__file__).with_name("moe_configs.json")


def token_bucket(tokens: int) -> int:
    return next((b for b in TOKEN_BUCKETS if b >= tokens), TOKEN_BUCKETS[-1])


def weight_kind(dtype: torch.dtype) -> str:
    """The table's name of a weight dtype: the 16-bit types run the same code at the same speed; float32
    (not measured) keeps the defaults."""
    return "fp8" if dtype == FP8_DTYPE else "32" if dtype == torch.float32 else "16"


def load_table(path: Path = TABLE_PATH) -> dict[tuple, Any]:
    """The kept table (bench_moe.py --tune writes it): (path, E, N, K, weight kind, token bucket) ->
    configuration, with path "gemv" (MoeDecodeConfig), "grouped" (MoeConfig), "router" (RouterConfig:
    the router's [E, H] weight), or "choice" (True: the decode shape was faster at this bucket, keyed by
    E, top_k, H and I instead of N and K)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    table: dict[tuple, Any] = {}
    for row in data.get("configs", []):
        cls = {"gemv": MoeDecodeConfig, "grouped": MoeConfig, "router": RouterConfig}[row["path"]]
        key = (row["path"], row["experts"], row["n"], row["k"], row["weights"], row["tokens"])
        table[key] = cls(**row["config"])
    for row in data.get("choices", []):
        key = ("choice", row["experts"], row["top_k"], row["hidden"], row["intermediate"], row["weights"],
               row["tokens"])  # fmt: skip
        table[key] = row["decode"]
    _fill_grouped_buckets(table)
    return table


def _fill_grouped_buckets(table: dict[tuple, Any]) -> None:
    """A grouped GEMM's bucket with no row of its own takes the row of the largest bucket below it that
    has one (a larger prefill is better served by the nearest tile measured than by the default)."""
    for key in [k for k in table if k[0] == "grouped"]:
        shape, bucket = key[:-1], key[-1]
        for above in TOKEN_BUCKETS[TOKEN_BUCKETS.index(bucket) + 1 :]:
            if (*shape, above) in table:
                break
            table[(*shape, above)] = table[key]


_TABLE = load_table()


def measured(path: str, e: int, n: int, k: int, dtype: torch.dtype, tokens: int) -> Any:
    """The table's configuration for E experts' [N, K] weights on one path ("gemv" or "grouped"), None
    where nothing was measured."""
    return _TABLE.get((path, e, n, k, weight_kind(dtype), token_bucket(tokens)))


def pick_config(pairs: int, e: int = 0, n: int = 0, k: int = 0, dtype: torch.dtype | None = None,
                tokens: int = 0) -> MoeConfig:  # fmt: skip
    """The measured tile for a grouped GEMM of E experts' [N, K] weights at this token count (or the
    nearest count below that was measured), else row tiles sized to the pairs an expert gets on average
    at most: small prefills waste less padding."""
    if INTERPRETING:
        return MoeConfig(block_m=16, block_n=16, block_k=32)
    found = measured("grouped", e, n, k, dtype, tokens) if dtype is not None else None
    return found or MoeConfig(block_m=16 if pairs <= 256 else 64)


def pick_decode_config(n: int, k: int, e: int = 0, dtype: torch.dtype | None = None,
                       tokens: int = 1) -> MoeDecodeConfig:  # fmt: skip
    """The measured tile for a decode GEMV of E experts' [N, K] weights at this token count, else the
    default."""
    if INTERPRETING:
        return MoeDecodeConfig(block_n=8, block_k=32)
    found = measured("gemv", e, n, k, dtype, tokens) if dtype is not None else None
    return found or MoeDecodeConfig()


def measured_choice(tokens: int, top_k: int, w13: torch.Tensor) -> bool | None:
    """Whether the decode shape measured faster than the grouped one for these experts at this token
    count; None where not measured."""
    e, two_i, h = w13.shape
    if tokens > TOKEN_BUCKETS[-1]:
        return None
    return _TABLE.get(("choice", e, top_k, h, two_i // 2, weight_kind(w13.dtype), token_bucket(tokens)))


def decode_shape_for(tokens: int, top_k: int, w13: torch.Tensor) -> bool:
    """The decode shape where the table measured it faster, else use_decode_shape's rule."""
    found = None if INTERPRETING else measured_choice(tokens, top_k, w13)
    return found if found is not None else use_decode_shape(tokens * top_k, w13.shape[0], top_k)


# ---------------------------------------------------------------- launchers


def _operands(a: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    """The kernels' operand options: bfloat16 rows times FP8 codes run as float16 (_as_f16)."""
    f16 = w.dtype == FP8_DTYPE and a.dtype == torch.bfloat16
    return {"F16_OPERANDS": f16, "PRECISION": dot_precision(torch.float16 if f16 else a.dtype)}


def expert_gemv_up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor | None, flat_ids: torch.Tensor,
                   top_k: int, cfg: MoeDecodeConfig) -> torch.Tensor:  # fmt: skip
    """mid [pairs, I] = SiLU(gate) * up of each pair's expert on its token's row of x (the decode shape)."""
    pairs, inter = flat_ids.numel(), w13.shape[1] // 2
    mid = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    s = s13 if s13 is not None else mid  # unread without HAS_SCALE
    _moe_gemv_kernel[(pairs, triton.cdiv(inter, cfg.block_n))](
        x, w13, s, mid, flat_ids, inter, w13.shape[2], x.stride(0), w13.stride(0), w13.stride(1),
        s.stride(0) if s13 is not None else 0, mid.stride(0), A_DIV=top_k, HAS_SCALE=s13 is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, **_operands(x, w13),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(),
    )  # fmt: skip
    return mid


def expert_gemv_down(mid: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor | None, route: torch.Tensor,
                     flat_ids: torch.Tensor, top_k: int, cfg: MoeDecodeConfig) -> torch.Tensor:  # fmt: skip
    """out [T, H] = the sum over each token's k pairs of weight * down(mid[pair]) (the decode shape)."""
    t, h = mid.shape[0] // top_k, w2.shape[1]
    out = torch.empty(t, h, dtype=mid.dtype, device=mid.device)
    s = s2 if s2 is not None else out
    n_blocks = triton.cdiv(h, cfg.block_n)
    split = cfg.pair_split if 1 < cfg.pair_split <= top_k and top_k % cfg.pair_split == 0 else 1
    # Without a split neither the partial sums nor the counts are read.
    parts = torch.empty(t, split, h, dtype=torch.float32, device=mid.device) if split > 1 else out
    arrivals = arrival_counts(mid.device, t * n_blocks) if split > 1 else out
    _moe_down_sum_kernel[(t, n_blocks, split)](
        mid, w2, s, out, route, flat_ids, parts, arrivals, h, w2.shape[2], mid.stride(0), w2.stride(0),
        w2.stride(1), s.stride(0) if s2 is not None else 0, out.stride(0), TOP_K=top_k, PAIR_SPLIT=split,
        HAS_SCALE=s2 is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
        **_operands(mid, w2), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(),
    )  # fmt: skip
    return out


def expert_gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, route: torch.Tensor,
                sorted_ids: torch.Tensor, block_expert: torch.Tensor, a_div: int, gated: bool,
                cfg: MoeConfig) -> torch.Tensor:  # fmt: skip
    """One grouped GEMM over the pairs moe_align sorted with cfg.block_m: [pairs, N] rows, SiLU(gate) * up
    (gated) or the down projection times each pair's routing weight."""
    pairs = route.numel()
    n = w.shape[1] // 2 if gated else w.shape[1]
    c = torch.empty(pairs, n, dtype=a.dtype, device=a.device)
    scale = s if s is not None else c
    _moe_gemm_kernel[(block_expert.numel(), triton.cdiv(n, cfg.block_n))](
        a, w, scale, c, route, sorted_ids, block_expert, n, w.shape[2], pairs, a.stride(0), w.stride(0),
        w.stride(1), scale.stride(0) if s is not None else 0, c.stride(0),
        A_DIV=a_div, GATED=gated, MUL_ROUTE=not gated, HAS_SCALE=s is not None, **_operands(a, w),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(),
    )  # fmt: skip
    return c


MoeConfigs = MoeConfig | MoeDecodeConfig | tuple[MoeConfig, MoeConfig] | tuple[MoeDecodeConfig, MoeDecodeConfig]


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    decode: bool | None = None,
    config: MoeConfigs | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing weights [T, k] and expert ids [T, k] (route_topk)
    -> sum over k of weight * down(SiLU(gate(x)) * up(x)) of each chosen expert, [T, H] in x's dtype.
    FP8 codes need their scales ([E, 2I], [E, H]). decode: the per-pair GEMV (default: the table's
    choice, else use_decode_shape). config: one for both projections, or (gate/up's, down's); default:
    the table's (pick_config, pick_decode_config)."""
    _check(x, w13, w2, w13_scale, w2_scale, ids)
    t, top_k = ids.shape
    e, two_i, h = w13.shape
    pairs = t * top_k
    if x.stride(-1) != 1:
        x = x.contiguous()
    if pairs == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    route = weights.reshape(-1).float().contiguous()
    flat_ids = ids.reshape(-1).to(torch.int32).contiguous()
    s13 = w13_scale.float().contiguous() if w13_scale is not None else None
    s2 = w2_scale.float().contiguous() if w2_scale is not None else None
    up_cfg, down_cfg = config if isinstance(config, tuple) else (config, config)
    if decode if decode is not None else decode_shape_for(t, top_k, w13):
        up_cfg = up_cfg if isinstance(up_cfg, MoeDecodeConfig) else pick_decode_config(two_i, h, e, w13.dtype, t)
        down_cfg = down_cfg if isinstance(down_cfg, MoeDecodeConfig) else \
            pick_decode_config(h, two_i // 2, e, w2.dtype, t)  # fmt: skip
        mid = expert_gemv_up(x, w13, s13, flat_ids, top_k, up_cfg)
        return expert_gemv_down(mid, w2, s2, route, flat_ids, top_k, down_cfg)
    up_cfg = up_cfg if isinstance(up_cfg, MoeConfig) else pick_config(pairs, e, two_i, h, w13.dtype, t)
    down_cfg = down_cfg if isinstance(down_cfg, MoeConfig) else pick_config(pairs, e, h, two_i // 2, w2.dtype, t)
    sorted_ids, block_expert = moe_align(flat_ids, e, up_cfg.block_m)
    mid = expert_gemm(x, w13, s13, route, sorted_ids, block_expert, top_k, True, up_cfg)
    if down_cfg.block_m != up_cfg.block_m:
        sorted_ids, block_expert = moe_align(flat_ids, e, down_cfg.block_m)
    out_rows = expert_gemm(mid, w2, s2, route, sorted_ids, block_expert, 1, False, down_cfg)
    return out_rows.view(t, top_k, h).sum(1)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor | None,
           s2: torch.Tensor | None, ids: torch.Tensor) -> None:  # fmt: skip
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2 or x.dim() != 2:
        raise ValueError(f"fused_moe needs x [T, H], w13 [E, 2I, H] and w2 [E, H, I], got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")  # fmt: skip
    e, two_i, h = w13.shape
    if tuple(w2.shape) != (e, h, two_i // 2) or x.shape[1] != h or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, ids {tuple(ids.shape)}")  # fmt: skip
    for w, s, rows in ((w13, s13, two_i), (w2, s2, h)):
        if w.dtype not in WEIGHT_DTYPES or w.stride(-1) != 1:
            raise ValueError(f"expert weights must be {WEIGHT_DTYPES}, contiguous in K; got {w.dtype}")
        if (w.dtype == FP8_DTYPE) != (s is not None) or (s is not None and tuple(s.shape) != (e, rows)):
            raise ValueError(f"FP8 expert codes need [{e}, {rows}] scales and 16-bit weights none")


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in torch, expert by expert over the tokens that chose it (the CPU path of the expert
    layer): each expert's output in x's dtype, weighted, and summed over k in float32."""
    t, top_k = ids.shape
    out = torch.zeros(t, top_k, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1).long()
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        rows = x[pairs // top_k]
        g13 = _dequantized(w13[expert], w13_scale, expert, x.dtype)
        g2 = _dequantized(w2[expert], w2_scale, expert, x.dtype)
        gate, up = F.linear(rows, g13).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, g2)
        out.view(-1, x.shape[1])[pairs] = y.float() * weights.reshape(-1)[pairs, None].float()
    return out.sum(1).to(x.dtype)


def _dequantized(w: torch.Tensor, scale: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype) if scale is None else (w.float() * scale[expert].float()[:, None]).to(dtype)
