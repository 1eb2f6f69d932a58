"""Fused RMSNorm (+ residual), in-place rotary (alone and fused with the KV write) and SiLU-and-mul
against their torch references."""

from __future__ import annotations

import pytest
import torch
from tokenspeed_kernels.activation import silu_and_mul, silu_and_mul_reference
from tokenspeed_kernels.kv_write import write_kv
from tokenspeed_kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from tokenspeed_kernels.rotary import QKNorm, rotary_inplace, rotary_reference, rotate_and_write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_and_fused_residual(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    weight = torch.randn(48, generator=gen).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), atol=tol, rtol=tol
    )
    res_kernel, res_ref = residual.clone(), residual.clone()
    out = add_rms_norm(x, res_kernel, weight, 1e-6)
    ref = add_rms_norm_reference(x, res_ref, weight, 1e-6)
    assert torch.equal(res_kernel, res_ref)  # the add rounds exactly as torch does
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


# 6 tokens: one head a program; 20: several (7 + 3 heads: two programs a token, q and k within one).
@pytest.mark.parametrize(("dtype", "tokens"), [(torch.float32, 6), (torch.float16, 6), (torch.float16, 20)])
def test_rotary_in_place_on_fused_views(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 7, 3, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    angles = torch.rand(64, dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    ref_q, ref_k = rotary_reference(q.clone(), k.clone(), cos, sin, positions)
    rotary_inplace(q, k, cos, sin, positions)
    # Bit-exact: every product and sum rounded to the dtype as torch rounds it.
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


HEADS, KV_HEADS, DIM = 7, 3, 16  # the fused-QKV cases: 7 query heads, 3 KV heads of 16


def rotary_case(seed: int, tokens: int, dtype: torch.dtype, scale: float) -> tuple:
    """(generator, cos and sin tables of 64 positions, positions, cache slots of 24, a fused QKV row a
    token)."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(64, DIM // 2, generator=gen) * 6
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(24, generator=gen)[:tokens]
    qkv = (torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen) * scale).to(dtype)
    return gen, angles.cos(), angles.sin(), positions, slots, qkv


def qkv_views(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, HEADS, DIM], k and v [T, KV_HEADS, DIM]: views of the fused rows x."""
    q, k, v = x.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
    return q.view(-1, HEADS, DIM), k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)


# 5 tokens: one head a program; 20: eight heads a program, q and k heads within one.
@pytest.mark.parametrize(("dtype", "tokens", "write"), [(torch.float32, 5, True), (torch.float16, 5, True),
                                                       (torch.float16, 20, False)])  # fmt: skip
def test_rotary_with_qk_norm_equals_the_norms_then_the_rotation(dtype: torch.dtype, tokens: int, write: bool) -> None:
    """Qwen3's per-head q/k norms in the rotary launch: the values of rms_norm then the rotation (16-bit:
    an ulp apart at most, where the order of the sum of squares matters), the same cache write."""
    gen, cos, sin, positions, slots, qkv = rotary_case(4, tokens, dtype, 3.0)
    norm = QKNorm(torch.rand(DIM, generator=gen).to(dtype) + 0.5, torch.rand(DIM, generator=gen).to(dtype) + 0.5, 1e-6)
    x = qkv.clone()
    q, k, v = qkv_views(x)
    caches = [torch.zeros(24, KV_HEADS, DIM, dtype=dtype) for _ in range(2)]
    if write:
        rotate_and_write_kv(q, k, v, cos, sin, positions, *caches, slots, qk_norm=norm)
    else:
        rotary_inplace(q, k, cos, sin, positions, qk_norm=norm)
    q0, k0, v0 = qkv_views(qkv)
    ref_q, ref_k = rotary_reference(rms_norm_reference(q0, norm.q_weight, 1e-6), rms_norm_reference(k0, norm.k_weight, 1e-6),
                                    cos, sin, positions)  # fmt: skip
    tol = 1e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, ref_k, atol=tol, rtol=tol)
    assert torch.equal(v, v0)  # v untouched
    if write:
        assert torch.equal(caches[0][slots], k) and torch.equal(caches[1][slots], v)
    with pytest.raises(ValueError, match="norm's weight"):
        rotary_inplace(q, k, cos, sin, positions, qk_norm=QKNorm(norm.q_weight[:8], norm.k_weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(dtype)  # two column blocks
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=tol, rtol=tol)


@pytest.mark.slow  # interpreted kernels over many heads
@pytest.mark.parametrize(
    ("cache_dtype", "tokens"),
    [(torch.float32, 5), (torch.float16, 5), (torch.float8_e4m3fn, 5), (torch.float16, 20), (torch.float8_e4m3fn, 20)],
)
def test_fused_rotary_and_kv_write_equal_the_two_kernels(cache_dtype: torch.dtype, tokens: int) -> None:
    """rotate_and_write_kv: the same bits as rotary_inplace then write_kv, on views of a fused QKV row."""
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.float16
    scales = (0.5, 0.25) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    _, cos, sin, positions, slots, qkv = rotary_case(3, tokens, dtype, 4.0)
    heads, kv_heads, dim = HEADS, KV_HEADS, DIM
    results = []
    for fused in (True, False):
        x = qkv.clone()
        q, k, v = qkv_views(x)
        caches = [torch.zeros(24, kv_heads, dim).to(cache_dtype) for _ in range(2)]
        if fused:
            rotate_and_write_kv(q, k, v, cos, sin, positions, *caches, slots, *scales)
        else:
            rotary_inplace(q, k, cos, sin, positions)
            write_kv(k, v, *caches, slots, *scales)
        results.append([x, *(c.view(torch.uint8) for c in caches)])
    for fused, unfused in zip(*results, strict=True):
        assert torch.equal(fused, unfused)
    assert results[0][1].any() and results[0][2].any()  # both caches were written
    # The rotated q into a buffer of its own: the same values there, q untouched, the same cache.
    x = qkv.clone()
    q, k, v = qkv_views(x)
    caches = [torch.zeros(24, kv_heads, dim).to(cache_dtype) for _ in range(2)]
    q_out = torch.full((tokens, heads, dim), 7.0, dtype=dtype)
    rotate_and_write_kv(q, k, v, cos, sin, positions, *caches, slots, *scales, q_out=q_out)
    rotated = results[0][0]
    assert torch.equal(q_out, rotated[:, : heads * dim].view(tokens, heads, dim))
    assert torch.equal(x[:, : heads * dim], qkv[:, : heads * dim])
    assert torch.equal(x[:, heads * dim :], rotated[:, heads * dim :])
    assert all(torch.equal(c.view(torch.uint8), r) for c, r in zip(caches, results[0][1:], strict=True))
