"""The MoE kernels (kernels/moe.py) under the interpreter against their torch references: the router
(softmax and top-k, renormalised or not, ties to the lowest expert id), the grouping of pairs by expert,
and the fused experts in both shapes (grouped GEMM and per-pair GEMV), 16-bit and FP8 weights, with
every expert chosen and ragged tiles (shapes that are not multiples of the blocks)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from tokenspeed_kernels import moe
from tokenspeed_kernels.common import FP8_DTYPE
from tokenspeed_kernels.moe import (
    MoeConfig,
    MoeDecodeConfig,
    expert_gemv_down,
    fused_moe,
    fused_moe_reference,
    moe_align,
    route_topk,
    route_topk_reference,
    use_decode_shape,
)

from app.worker.quantization.fp8 import quantize_rows
from tests.support.numerics import relative_error


@pytest.mark.parametrize("renormalize", [False, True])
def test_router_matches_reference_with_ties(renormalize: bool) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=g)
    logits[1] = 0.0  # every expert equal: ids 0..k-1
    logits[2, 3] = logits[2, 7] = 5.0  # a tie at the top: 3 before 7
    weights, ids = route_topk(logits, 3, renormalize)
    ref_w, ref_ids = route_topk_reference(logits, 3, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    assert ids[1].tolist() == [0, 1, 2] and ids[2, :2].tolist() == [3, 7]
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(6))
    # the reference agrees with transformers' softmax + topk where nothing ties
    top = torch.topk(torch.softmax(logits[0], -1), 3)
    assert ids[0].tolist() == top.indices.tolist()


@pytest.mark.parametrize("experts", [128, 300])  # every rank at once; k rounds (over RANK_MAX_EXPERTS)
def test_router_top_k_of_many_experts_with_ties(experts: int) -> None:
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(4, experts, generator=g)
    logits[0, ::7] = 4.0  # ties at the top, more of them than k
    logits[3] = -1.0
    weights, ids = route_topk(logits, 8, renormalize=True)
    ref_w, ref_ids = route_topk_reference(logits, 8, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def test_router_names_real_experts_for_a_nan_row() -> None:
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    logits[1, 2] = float("nan")
    weights, ids = route_topk(logits, 2, renormalize=True)
    assert ((ids >= 0) & (ids < 6)).all()
    assert torch.isfinite(weights[[0, 2]]).all()  # the other tokens untouched


def test_align_groups_pairs_by_expert() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]], dtype=torch.int32)  # expert 1 unused
    sorted_ids, block_expert = moe_align(ids, 4, block_m=2)
    pairs = ids.numel()
    flat = ids.reshape(-1)
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        rows = [p for p in sorted_ids[b * 2 : b * 2 + 2].tolist() if p < pairs]
        if expert < 0:
            assert not rows
        assert all(flat[p] == expert for p in rows)
        seen += rows
    assert sorted(seen) == list(range(pairs))  # every pair exactly once


# 100 x 8: 800 pairs, four chunks of ALIGN_CHUNK (256)
@pytest.mark.parametrize(("t", "k", "e", "block_m"), [(37, 3, 10, 4), (8, 8, 128, 16), (1, 2, 8, 16), (50, 2, 5, 2),
                                                      (100, 8, 128, 16)])  # fmt: skip
def test_align_kernel_equals_the_torch_reference(t: int, k: int, e: int, block_m: int) -> None:
    """The align kernels (chunks sorted in registers) write exactly what the torch version does: the same
    order within each expert (pair order), padding and block experts; a skewed draw leaves experts empty."""
    g = torch.Generator().manual_seed(t + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    if t > 1:
        ids[: t // 2] = torch.arange(k, dtype=torch.int32)  # half the tokens on the first k experts
    got = moe.moe_align(ids, e, block_m)
    want = moe.moe_align_reference(ids, e, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _experts(e: int, h: int, inter: int, fp8: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.2
    w2 = torch.randn(e, h, inter, generator=g) * 0.2
    if not fp8:
        return w13, w2, None, None
    (c13, s13), (c2, s2) = (quantize_rows(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
    return c13.view(w13.shape), c2.view(w2.shape), s13.view(e, -1), s2.view(e, -1)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32 weights", "fp8 weights"])
@pytest.mark.parametrize("decode", [True, "dot", False], ids=["per-pair gemv", "per-pair gemv dot", "grouped gemm"])
def test_fused_moe_matches_reference(decode: bool | str, fp8: bool) -> None:
    e, h, inter, t, k = 5, 40, 24, 7, 2
    w13, w2, s13, s2 = _experts(e, h, inter, fp8)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(2))
    weights, ids = route_topk(logits, k, renormalize=True)
    ids[:e, 0] = torch.arange(e, dtype=torch.int32)  # every expert chosen at least once
    ids[:e, 1] = (ids[:e, 0] + 1) % e
    config = MoeDecodeConfig(block_n=16, block_k=32, use_dot=decode == "dot") if decode else \
        MoeConfig(block_m=16, block_n=16, block_k=16)  # fmt: skip
    out = fused_moe(x, w13, w2, weights, ids, s13, s2, decode=bool(decode), config=config)
    ref = fused_moe_reference(x, w13, w2, weights, ids, s13, s2)
    assert out.shape == (t, h)
    assert relative_error(out, ref) < 1e-5


def test_fused_moe_handles_no_tokens() -> None:
    w13, w2, _, _ = _experts(3, 16, 8, fp8=False)
    out = fused_moe(torch.zeros(0, 16), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 16)


def test_fused_moe_refuses_codes_without_scales() -> None:
    w13, w2, _, _ = _experts(3, 16, 8, fp8=False)
    with pytest.raises(ValueError, match="scales"):
        fused_moe(torch.zeros(1, 16), w13.to(FP8_DTYPE), w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32))


def test_decode_shape_while_pairs_pick_distinct_experts() -> None:
    assert use_decode_shape(8, 128, 8) and use_decode_shape(64, 128, 8)  # Qwen3-30B-A3B, batch 1 and 8
    assert not use_decode_shape(72, 128, 8)
    assert use_decode_shape(2, 8, 2) and use_decode_shape(4, 8, 2)  # Mixtral, batch 1 and 2
    assert not use_decode_shape(8, 8, 2)  # batch 4: the grouped GEMM reads each expert once


def test_default_shape_matches_reference() -> None:
    w13, w2, _, _ = _experts(4, 24, 16, fp8=False)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(3))
    weights, ids = route_topk(torch.randn(6, 4, generator=torch.Generator().manual_seed(4)), 2, renormalize=False)
    out = fused_moe(x, w13, w2, weights, ids)  # 12 pairs of 4 experts: grouped
    assert relative_error(out, fused_moe_reference(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize(("use_dot", "pair_split"), [(False, 1), (True, 1), (False, 3), (True, 3), (False, 2)],
                         ids=["fma", "dot", "fma, pairs over 3 programs", "dot, pairs over 3 programs",
                              "a split not dividing k: none"])  # fmt: skip
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32 weights", "fp8 weights"])
def test_decode_down_sums_each_tokens_pairs(fp8: bool, use_dot: bool, pair_split: int) -> None:
    """The decode shape's down kernel takes the top-k weighted sum itself: against the sum in torch of
    each pair's down projection, with N not a multiple of the tile, in both forms (FMA, tensor cores),
    the pairs in one program or spread over several (partials summed by the last to finish)."""
    e, h, inter, t, k = 6, 36, 20, 3, 3
    _, w2, _, s2 = _experts(e, h, inter, fp8)
    g = torch.Generator().manual_seed(5)
    mid = torch.randn(t * k, inter, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32).reshape(-1)
    route = torch.rand(t * k, generator=g)
    cfg = MoeDecodeConfig(block_n=16, block_k=16, use_dot=use_dot, pair_split=pair_split)
    out = expert_gemv_down(mid, w2, s2, route, ids, k, cfg)
    d2 = w2.float() if s2 is None else w2.float() * s2[..., None]
    rows = torch.stack([route[p] * (d2[ids[p]] @ mid[p]) for p in range(t * k)]).view(t, k, h)
    assert out.shape == (t, h)
    torch.testing.assert_close(out, rows.sum(1), rtol=1e-5, atol=1e-5)
    assert moe.arrival_counts(out.device, 64).eq(0).all()  # left at zero for the next kernel


@pytest.mark.parametrize("decode", [True, False], ids=["per-pair gemv", "grouped gemm"])
def test_fused_moe_takes_a_config_per_projection(decode: bool) -> None:
    e, h, inter, t, k = 4, 24, 40, 5, 2
    w13, w2, _, _ = _experts(e, h, inter, fp8=False)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(6))
    weights, ids = route_topk(torch.randn(t, e, generator=torch.Generator().manual_seed(7)), k, renormalize=True)
    if decode:
        configs = (MoeDecodeConfig(block_n=16, block_k=16), MoeDecodeConfig(block_n=4, block_k=64))
    else:  # different row tiles: the pairs are grouped again for down
        configs = (MoeConfig(block_m=16, block_n=16, block_k=16), MoeConfig(block_m=32, block_n=32, block_k=16))
    out = fused_moe(x, w13, w2, weights, ids, decode=decode, config=configs)
    assert relative_error(out, fused_moe_reference(x, w13, w2, weights, ids)) < 1e-5


def _table_json(path: Path) -> Path:
    path.write_text(json.dumps({
        "configs": [
            {"path": "gemv", "experts": 128, "n": 1536, "k": 2048, "weights": "16", "tokens": 4,
             "config": {"block_n": 4, "block_k": 256, "num_warps": 2, "num_stages": 4}},
            {"path": "grouped", "experts": 128, "n": 2048, "k": 768, "weights": "fp8", "tokens": 512,
             "config": {"block_m": 32, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}},
            {"path": "router", "experts": 128, "n": 128, "k": 2048, "weights": "16", "tokens": 1,
             "config": {"slice_e": 16, "block_h": 512, "num_warps": 2}, "unfused_us": 9.0},
        ],
        "choices": [{"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768, "weights": "16",
                     "tokens": 16, "decode": True}],
    }))  # fmt: skip
    return path


def test_table_lookup_by_shape_kind_and_token_bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe, "_TABLE", moe.load_table(_table_json(tmp_path / "t.json")))
    bf16, fp8 = torch.bfloat16, FP8_DTYPE
    assert moe.token_bucket(3) == 4 and moe.token_bucket(4) == 4 and moe.token_bucket(10_000) == 16384
    # 3 and 4 tokens share bucket 4; float16 is a 16-bit kind too; float32 and other shapes are not measured
    assert moe.measured("gemv", 128, 1536, 2048, bf16, 3) == MoeDecodeConfig(4, 256, 2, 4)
    assert moe.measured("gemv", 128, 1536, 2048, torch.float16, 4) == MoeDecodeConfig(4, 256, 2, 4)
    assert moe.measured("gemv", 128, 1536, 2048, torch.float32, 4) is None
    assert moe.measured("gemv", 128, 1536, 2048, bf16, 5) is None
    assert moe.measured("gemv", 128, 2048, 768, bf16, 4) is None
    assert moe.measured("grouped", 128, 2048, 768, fp8, 300) == MoeConfig(32, 128, 64, 8, 3)
    assert moe.measured("router", 128, 128, 2048, bf16, 1) == moe.RouterConfig(16, 512, 2)
    w13 = torch.empty(128, 2 * 768, 2048, dtype=bf16, device="meta")
    assert moe.measured_choice(9, 8, w13) is True  # bucket 16: the decode shape, past use_decode_shape's 8
    assert moe.measured_choice(17, 8, w13) is None
    # a grouped GEMM past the buckets measured takes the largest one below it, none below: the default
    monkeypatch.setattr(moe, "INTERPRETING", False)
    assert moe.pick_config(160_000, 128, 2048, 768, fp8, 20_000) == MoeConfig(32, 128, 64, 8, 3)
    assert moe.pick_config(800, 128, 2048, 768, fp8, 100) == MoeConfig(block_m=64)


def test_shipped_table_loads() -> None:
    """kernels/moe_configs.json (what the H200 tuning measured) parses into valid configurations."""
    table = moe.load_table()
    assert table, "the H200 tuning's table is shipped"
    for key, cfg in table.items():
        assert key[0] in ("gemv", "grouped", "router", "choice") and key[-1] in moe.TOKEN_BUCKETS, key
        if key[0] != "choice":
            tile = (cfg.slice_e, cfg.block_h) if key[0] == "router" else (cfg.block_n, cfg.block_k)
            assert all(v & (v - 1) == 0 for v in tile), (key, cfg)


def test_tuning_smoke_run_writes_a_table(tmp_path: Path) -> None:
    """bench_moe.py --tune end to end on a tiny shape in the interpreter: the JSON it writes is a table
    kernels/moe.py reads, with both decode kernels, both grouped GEMMs, the router and the choice of
    shape."""
    from scripts.gpu import bench_moe

    out = tmp_path / "tune.json"
    bench_moe.main(["--tune", "--smoke", "--tune-weights", "16,fp8", "--tune-tokens", "1", "--json", str(out)])
    table = moe.load_table(out)
    e, h, inter = 4, 32, 24
    for kind in ("32", "fp8"):  # the smoke run's "16" experts are float32: the interpreter has no bfloat16
        for path, (n, k) in itertools.product(("gemv", "grouped"), ((2 * inter, h), (h, inter))):
            assert (path, e, n, k, kind, 1) in table, (path, n, k, kind)
        assert isinstance(table[("choice", e, 2, h, inter, kind, 1)], bool)
    assert isinstance(table[("router", e, e, h, "32", 1)], moe.RouterConfig)  # the router is 16-bit, never FP8
    assert not any(key[0] == "router" and key[4] == "fp8" for key in table)


@pytest.mark.parametrize("renormalize", [False, True])
def test_router_linear_in_one_launch_matches_linear_then_route(renormalize: bool) -> None:
    """route_linear_topk: the router linear, softmax and top-k in one launch, against torch's linear and
    the reference routing. Small integers keep every logit exact, so the ids must be equal, ties too
    (a token whose x is zero: every expert equal, ids 0..k-1; two equal weight rows: the lower id first);
    E not a multiple of the slice, H not of the block."""
    g = torch.Generator().manual_seed(8)
    e, h, t, k = 10, 40, 5, 3
    x = torch.randint(-3, 4, (t, h), generator=g).float()
    w = torch.randint(-2, 3, (e, h), generator=g).float() / 8
    x[1] = 0.0
    w[7] = w[2]
    x[3] = w[2] * 8  # experts 2 and 7 on top for token 3, tied
    weights, ids = moe.route_linear_topk(x, w, k, renormalize)
    ref_w, ref_ids = route_topk_reference(torch.nn.functional.linear(x, w), k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    assert ids[1].tolist() == [0, 1, 2] and ids[3, :2].tolist() == [2, 7]
    # the counts each token's last program finds are left at zero for the next kernel
    assert moe.arrival_counts(x.device, t)[:t].eq(0).all()


def test_router_linear_refuses_a_mismatched_weight() -> None:
    with pytest.raises(ValueError, match="router weight"):
        moe.route_linear_topk(torch.zeros(2, 8), torch.zeros(4, 6), 2, True)
