"""Paged decode / prefill attention kernels and the KV write against their torch references."""

from __future__ import annotations

import math

import pytest
import torch
from tokenspeed_kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from tokenspeed_kernels.kv_write import write_kv, write_kv_reference
from tokenspeed_kernels.page_table import flatten_block_tables, flatten_block_tables_reference
from tokenspeed_kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_reference

from tests.support.compile_kernels import check_in_compiler_process
from tests.support.numerics import relative_error as rel_err


def paged_cache(
    lengths: list[int], page: int, kv_heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches with shuffled, non-contiguous block tables (padded with block 0)."""
    pages = [math.ceil(n / page) for n in lengths]
    total = sum(pages) + 2
    order = torch.randperm(total, generator=gen).tolist()
    width = max(pages) + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages):
        table[b, :count] = torch.tensor(order[used : used + count])
        used += count
    k = torch.randn(total, page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, page, kv_heads, dim, generator=gen).to(dtype)
    return k, v, table



@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page", "splits", "dtype"),
    [
        (4, 2, 16, 4, 1, torch.float32),
        (8, 2, 32, 16, 3, torch.float32),  # GQA group 4, several splits, some empty
        (4, 4, 24, 8, 2, torch.float16),  # MHA, head_dim not a power of two
    ],
)
def test_decode_matches_reference(
    heads: int, kv_heads: int, dim: int, page: int, splits: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    lengths = [1, 70, 131]
    k, v, table = paged_cache(lengths, page, kv_heads, dim, dtype, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, seq_lens, dim**-0.5, splits, out=out)
    ref = paged_decode_attention_reference(q, k, v, table, seq_lens, dim**-0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("block_n", [32, 128])
def test_decode_tile_options(block_n: int) -> None:
    """Other context tiles (the tuning benchmark's) give the same result; splits follow the tile."""
    gen = torch.Generator().manual_seed(block_n)
    lengths = [1, 70, 300]
    k, v, table = paged_cache(lengths, 16, 2, 32, torch.float32, gen)
    q = torch.randn(len(lengths), 8, 32, generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    splits = choose_num_splits(len(lengths), 2, max(lengths), num_sms=4, block_n=block_n)
    out = paged_decode_attention(q, k, v, table, seq_lens, 32**-0.5, splits, block_n=block_n, num_warps=4)
    assert rel_err(out, paged_decode_attention_reference(q, k, v, table, seq_lens, 32**-0.5)) < 1e-5


@pytest.mark.parametrize("splits", [1, 2])  # one piece: the split kernel writes the output itself
def test_decode_reads_and_writes_strided_views(splits: int) -> None:
    gen = torch.Generator().manual_seed(7)
    k, v, table = paged_cache([33, 5], 8, 2, 16, torch.float32, gen)
    qkv = torch.randn(2, (4 + 2 * 2) * 16, generator=gen)
    q = qkv[:, : 4 * 16].view(2, 4, 16)  # a view of the fused projection, row stride 128
    seq_lens = torch.tensor([33, 5], dtype=torch.int32)
    rows = torch.full((2, 2 * 4 * 16), float("nan"))
    out = rows[:, 4 * 16 :].view(2, 4, 16)  # an output view with row stride 128
    paged_decode_attention(q, k, v, table, seq_lens, 0.25, splits, out=out)
    assert rel_err(out, paged_decode_attention_reference(q, k, v, table, seq_lens, 0.25)) < 1e-5
    assert rows[:, : 4 * 16].isnan().all()  # nothing written outside the view


def test_num_splits_heuristic() -> None:
    assert choose_num_splits(1, 8, 4096, 132) == 33
    assert choose_num_splits(256, 8, 4096, 132) == 1
    assert choose_num_splits(1, 8, 10, 132) == 1  # never more pieces than BLOCK_N-token chunks


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_prefill_with_cached_prefix_matches_reference(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, page = 4, 2, 16, 8
    seq_lens_list = [9, 80, 5, 67]
    query_lens = [9, 70, 1, 3]  # a full prompt, a long chunk after a prefix, a decode, a short extend
    k, v, table = paged_cache(seq_lens_list, page, kv_heads, dim, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k, v, table, cu, seq_lens, max(query_lens), dim**-0.5, out=out)
    ref = paged_prefill_attention_reference(q, k, v, table, cu, seq_lens, dim**-0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol


def test_write_kv_scatters_strided_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, (2 + 2 + 2) * 8, generator=gen)
    k = qkv[:, 16:32].view(5, 2, 8)
    v = qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([17, 3, 0, 30, 9])
    caches = [torch.zeros(4, 8, 2, 8) for _ in range(4)]
    write_kv(k, v, caches[0], caches[1], slots)
    write_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


def test_flatten_block_tables() -> None:
    table = torch.randint(0, 1000, (3, 300), dtype=torch.int32)
    indptr = torch.tensor([0, 1, 1 + 257, 1 + 257 + 4], dtype=torch.int32)
    out = flatten_block_tables(table, indptr, int(indptr[-1]))
    assert torch.equal(out, flatten_block_tables_reference(table, indptr))


def split_loop_loads() -> int:
    """Run in a fresh process: compiles the decode split kernel for sm_90 (PDL on; bf16 and FP8 caches,
    several tiles a piece) and counts the loads in its K/V loop that are not asynchronous copies: the
    pipeliner requests the pages and the K/V tiles stages ahead only while each load's address comes from
    the loop's position (a page carried over from the iteration before left its loads synchronous, and the
    step 3% slower at batch 64 on the H200)."""
    from tests.support.compile_kernels import count_unpipelined

    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    tables, lengths = torch.zeros(4, 40, dtype=torch.int32), torch.full((4,), 640, dtype=torch.int32)
    cases = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k_cache = torch.zeros(64, 16, 8, 128).to(dtype)
        cases.append((f"{dtype} cache", lambda k=k_cache: paged_decode_attention(q, k, k.clone(), tables, lengths, 0.1, 1)))
    return count_unpipelined(cases)


@pytest.mark.slow  # compiles for sm_90
def test_decode_split_loop_loads_are_pipelined_on_sm90() -> None:
    check_in_compiler_process("tests.kernels.test_attention_kernels:split_loop_loads")
