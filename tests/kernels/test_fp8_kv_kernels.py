"""The FP8 (e4m3) KV cache in the Triton kernels and the triton backend, under the interpreter.

- the fused write stores exactly the codes torch's `(x / scale).clamp(-448, 448).to(float8_e4m3fn)`
  gives: every e4m3 value, every rounding midpoint (ties to even) and its neighbours, +-0, subnormals,
  saturation;
- decode and prefill over an FP8 cache against a float64 reference over the dequantized cache
  (value = code x scale). Both read the same codes exactly, so what is left is the kernels' own
  arithmetic: REL_TOL[dtype] in relative L2 error. float32 queries: 1e-5 (float32 accumulation);
  float16: 2e-3 (the probabilities are rounded to float16 for the P.V product, 2^-11 relative each,
  and so is the output). bfloat16 (2^-8: 1e-2) runs in tests/gpu/test_fp8_kv_backends.py: Triton's
  interpreter has no bfloat16 dot;
- the triton backend on an FP8 cache against the torch backend on the same cache (the same bytes
  written, outputs equal to float32 rounding), and the model runner on it against the torch
  backend's FP8 run (identical greedy tokens);
- which backends read FP8 and how the default falls back for one that does not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tokenspeed_kernels.decode_attention import paged_decode_attention, paged_decode_attention_reference
from tokenspeed_kernels.kv_write import write_kv, write_kv_reference
from tokenspeed_kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_reference

from app.worker.attention import backend_class, build_attention_batch, make_attention_backend
from app.worker.attention.base import AttentionSpec
from app.worker.attention.flashinfer_backend import query_and_kv_dtypes
from app.worker.kv_cache import KVCache, KVCacheSpec
from app.worker.model_runner import ModelRunner
from app.worker.quantization import fp8_kv_backend
from tests.kernels.test_attention_kernels import paged_cache
from tests.support.model_factory import build_tiny_model
from tests.support.numerics import relative_error as rel_err
from tests.unit.test_model_runner import Request, ScriptedScheduler, make_settings, prompts_for

FP8 = torch.float8_e4m3fn
CPU = torch.device("cpu")
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # bfloat16: on CUDA
INTERPRETED_DTYPES = [torch.float32, torch.float16]
SCALES = [(1.0, 1.0), (0.05, 0.02), (4.0, 0.5)]


def e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours and the floats just either side."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite()].unique()  # sorted, +0 and -0 merged
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, math.inf), torch.full_like(mids, -math.inf)
    extremes = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 500.0, -1e4, 448.0, 464.0, 465.0])
    return torch.cat([values, mids, mids.nextafter(up), mids.nextafter(down), extremes])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_write_stores_the_codes_torch_gives(dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    heads, dim = 2, 8
    probe = e4m3_probe_values()
    rows = -(-probe.numel() // (heads * dim))
    flat = torch.zeros(rows * heads * dim)
    flat[: probe.numel()] = probe
    gen = torch.Generator().manual_seed(0)
    # Strided rows, as views of a fused QKV projection: [T, (Hq + 2 Hkv) D] with Hq = Hkv here.
    qkv = torch.randn(rows, 3 * heads * dim, generator=gen)
    qkv[:, heads * dim : 2 * heads * dim] = flat.view(rows, -1) * k_scale
    qkv[:, 2 * heads * dim :] = -flat.view(rows, -1).flip(0) * v_scale
    qkv = qkv.to(dtype)
    k, v = (
        qkv[:, heads * dim : 2 * heads * dim].view(rows, heads, dim),
        qkv[:, 2 * heads * dim :].view(rows, heads, dim),
    )
    slots = torch.randperm(rows + 7, generator=gen)[:rows]
    caches = [torch.zeros(rows + 7, heads, dim, dtype=FP8) for _ in range(4)]
    write_kv(k, v, caches[0], caches[1], slots, k_scale, v_scale)
    write_kv_reference(k, v, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    stored = caches[0].view(torch.uint8)[slots]
    assert (stored == 0x80).any() and (stored == 0x7E).any()  # -0 kept, saturation reached 448


def test_scales_need_an_fp8_cache() -> None:
    k = torch.randn(2, 1, 4)
    cache = torch.zeros(4, 1, 4)
    with pytest.raises(ValueError, match="need an FP8 cache"):
        write_kv(k, k, cache, cache, torch.tensor([0, 1]), 2.0, 1.0)
    with pytest.raises(ValueError, match="need an FP8 cache"):
        paged_decode_attention(torch.randn(1, 1, 4), cache.view(1, 4, 1, 4), cache.view(1, 4, 1, 4),
                               torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                               0.5, 1, v_scale=0.5)  # fmt: skip


def fp8_cache(
    lengths: list[int], page: int, kv_heads: int, dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random FP8 caches: every code finite and spread over the e4m3 range (normal and subnormal)."""
    k, v, table = paged_cache(lengths, page, kv_heads, dim, torch.float32, gen)
    return (k * 40).clamp(-448, 448).to(FP8), (v * 0.01).to(FP8), table


def decode_case(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """q [3, 8, 32] for an FP8 cache of 2 KV heads and pages of 16, contexts of 1, 70 and 131 tokens:
    (q, k_cache, v_cache, block_table, seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 70, 131]
    k, v, table = fp8_cache(lengths, 16, 2, 32, gen)
    q = (torch.randn(len(lengths), 8, 32, generator=gen) * 0.05).to(dtype)
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32)


# bfloat16 queries too: the decode kernel multiplies float16 operands for an FP8 cache.
@pytest.mark.parametrize("dtype", [*INTERPRETED_DTYPES, torch.bfloat16])
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("splits", [3, 1])  # one piece: the longer FP8 tile (FP8_WHOLE_BLOCK_N)
def test_decode_reads_an_fp8_cache(dtype: torch.dtype, k_scale: float, v_scale: float, splits: int) -> None:
    q, k, v, table, seq_lens = decode_case(dtype, seed=5)
    dim = q.shape[-1]
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, seq_lens, dim**-0.5, splits, out=out, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_reference(q, k, v, table, seq_lens, dim**-0.5, k_scale, v_scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    # The scales matter: reading the codes as values is far off (unless both are 1).
    if (k_scale, v_scale) != (1.0, 1.0):
        assert rel_err(out, paged_decode_attention_reference(q, k, v, table, seq_lens, dim**-0.5)) > 0.1


@pytest.mark.parametrize("dtype", INTERPRETED_DTYPES)
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES[1:])
def test_prefill_reads_an_fp8_cache(dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, page = 4, 2, 16, 8
    seq_lens_list, query_lens = [9, 80, 5, 67], [9, 70, 1, 3]
    k, v, table = fp8_cache(seq_lens_list, page, kv_heads, dim, gen)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = (torch.randn(int(cu[-1]), heads, dim, generator=gen) * 0.05).to(dtype)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k, v, table, cu, seq_lens, max(query_lens), dim**-0.5, out=out,
                            k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    ref = paged_prefill_attention_reference(q, k, v, table, cu, seq_lens, dim**-0.5, k_scale, v_scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]


# ---------------------------------------------------------------- the triton backend

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"), [([1, 1, 1], [5, 40, 17]), ([1, 9, 3, 1], [12, 9, 30, 2])]
)
def test_triton_backend_on_fp8_matches_torch_backend(query_lens: list[int], seq_lens: list[int]) -> None:
    block_size = 4
    width = max(math.ceil(n / block_size) for n in seq_lens)
    tables = torch.randperm(len(seq_lens) * width, generator=torch.Generator().manual_seed(1)).int()
    tables = tables.view(len(seq_lens), width)
    spec = KVCacheSpec(1, SPEC.num_kv_heads, SPEC.head_dim, FP8)
    gen = torch.Generator().manual_seed(2)
    ours, ref = (KVCache(spec, len(seq_lens) * width, block_size, CPU, [0.05], [0.02]) for _ in range(2))
    for x, y in ((ours.k[0], ref.k[0]), (ours.v[0], ref.v[0])):  # an earlier context, already cached
        x.copy_((torch.randn(x.shape, generator=gen) * 30).to(FP8))
        y.copy_(x)
    triton_backend = make_attention_backend("triton", ours, SPEC)
    torch_backend = make_attention_backend("torch", ref, SPEC)
    batch = build_attention_batch(tables, query_lens, seq_lens, block_size)
    n = batch.num_tokens
    q = torch.randn(n, 4, 16, generator=gen)
    k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen) * 0.1
    out = triton_backend.forward(0, q, k, v, triton_backend.plan(batch))
    expected = torch_backend.forward(0, q, k, v, torch_backend.plan(batch))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.k[0].view(torch.uint8), ref.k[0].view(torch.uint8))  # the same codes written
    assert torch.equal(ours.v[0].view(torch.uint8), ref.v[0].view(torch.uint8))


@pytest.mark.slow  # a model through the interpreter
def test_runner_on_triton_with_fp8_cache_matches_the_torch_backend(tmp_path: Path) -> None:
    model_dir = build_tiny_model("qwen3", tmp_path / "m", seed=2, num_hidden_layers=2)
    scales = tmp_path / "kv.json"  # non-unit scales: the write and both reads must apply them
    scales.write_text(json.dumps({"kv_cache": {"dtype": "float8_e4m3fn", "k_scale": {"0": 0.05, "1": 0.1},
                                               "v_scale": {"0": 0.02, "1": 0.04}}}))  # fmt: skip
    outputs = {}
    for backend in ("triton", "torch"):
        runner = ModelRunner(make_settings(model_dir, attention_backend=backend, max_num_seqs=3,
                                           kv_cache_dtype="fp8", quantization_param_path=str(scales)), CPU)  # fmt: skip
        assert runner.ready_message().info.attention_backend == backend
        assert runner.kv_cache.k[0].dtype == FP8 and runner.kv_cache.k_scales == (0.05, 0.1)
        sched = ScriptedScheduler(runner)
        for i, prompt in enumerate(prompts_for(runner.vocab_size, [5, 21])):
            sched.add(Request(f"r{i}", prompt, max_new=8, join_step=2 * i))
        outputs[backend] = sched.run()
    assert outputs["triton"] == outputs["torch"]


# ---------------------------------------------------------------- which backends read FP8


def test_every_backend_reads_fp8_and_the_default_keeps_them() -> None:
    for name in ("torch", "triton", "flashinfer"):
        cls = backend_class(name)
        assert cls.supports_fp8_kv is True
        assert fp8_kv_backend(name, cls) == name

    class Plain:  # a backend that does not say it reads FP8 still falls back
        pass

    assert fp8_kv_backend("plain", Plain) == "torch"


def test_flashinfer_plans_for_the_query_dtype_over_an_fp8_cache() -> None:
    assert query_and_kv_dtypes(FP8, torch.bfloat16) == (torch.bfloat16, FP8)
    assert query_and_kv_dtypes(torch.float16, None) == (torch.float16, torch.float16)
    assert query_and_kv_dtypes(torch.bfloat16, torch.bfloat16) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="names the query dtype"):
        query_and_kv_dtypes(FP8, None)
    with pytest.raises(ValueError, match="float16 and bfloat16, not torch.float32"):
        query_and_kv_dtypes(FP8, torch.float32)
    with pytest.raises(ValueError, match="not a torch.float16 one"):
        query_and_kv_dtypes(torch.float16, torch.bfloat16)
