"""The torch attention backend against a naive dense causal attention reference."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.worker.attention import (
    AttentionBatch,
    AttentionSpec,
    TorchAttentionBackend,
    build_attention_batch,
    make_attention_backend,
)
from app.worker.attention.torch_backend import CPU_DECODE_GROUP_TOKENS, lower_right_causal
from app.worker.kv_cache import KVCache, KVCacheSpec

HEADS, KV_HEADS, DIM = 4, 2, 8
SPEC = AttentionSpec(HEADS, KV_HEADS, DIM, DIM**-0.5)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] = the last n positions of a sequence whose K/V are k, v [L, Hkv, D]."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        scores = (q[:, h] @ k[:, h // group].T) * scale  # [n, L]
        q_pos = torch.arange(length - n, length).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(length).unsqueeze(0) > q_pos, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


class Sequences:
    """Dense K/V histories of several sequences, mirrored into a paged cache with shuffled blocks."""

    def __init__(self, lengths: list[int], block_size: int, num_layers: int = 2, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.lengths = lengths
        blocks_per_seq = [math.ceil((n + 8) / block_size) for n in lengths]  # room to grow
        total = sum(blocks_per_seq) + 3
        order = torch.randperm(total, generator=self.gen).tolist()  # non-contiguous, any id incl. 0
        self.tables, used = [], 0
        for count in blocks_per_seq:
            self.tables.append(order[used : used + count])
            used += count
        spec = KVCacheSpec(num_layers, KV_HEADS, DIM, dtype)
        self.cache = KVCache(spec, total, block_size, torch.device("cpu"))
        self.backend = TorchAttentionBackend(self.cache, SPEC)
        self.k = [torch.randn(n, KV_HEADS, DIM, generator=self.gen).to(dtype) for n in lengths]
        self.v = [torch.randn(n, KV_HEADS, DIM, generator=self.gen).to(dtype) for n in lengths]

    def table_tensor(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)

    def fill_prefix(self, layer: int, cached: list[int]) -> None:
        """Write the first cached[b] tokens of every sequence straight into the cache."""
        for b, count in enumerate(cached):
            for pos in range(count):
                slot = self.tables[b][pos // self.block_size] * self.block_size + pos % self.block_size
                self.cache.k[layer].view(-1, KV_HEADS, DIM)[slot] = self.k[b][pos]
                self.cache.v[layer].view(-1, KV_HEADS, DIM)[slot] = self.v[b][pos]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_plus_new_tokens_match_dense_attention(block_size: int) -> None:
    lengths = [1, 7, 19, 33, 16]
    cached = [0, 0, 11, 20, 15]  # 0: fresh prefill; len-1: decode; others: prefix + a chunk
    seqs = Sequences(lengths, block_size)
    layer = 1
    seqs.fill_prefix(layer, cached)
    query_lens = [n - c for n, c in zip(lengths, cached, strict=True)]
    batch = build_attention_batch(seqs.table_tensor(), query_lens, lengths, block_size)
    meta = seqs.backend.plan(batch)
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=seqs.gen)
    k = torch.cat([seqs.k[b][c:] for b, c in enumerate(cached)])
    v = torch.cat([seqs.v[b][c:] for b, c in enumerate(cached)])
    out = seqs.backend.forward(layer, q, k, v, meta)
    for b in range(len(lengths)):
        rows = slice(batch.query_start_loc[b], batch.query_start_loc[b + 1])
        expected = naive_attention(q[rows], seqs.k[b], seqs.v[b], SPEC.scale)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
    # The new tokens' K/V landed in their slots; the other layer's cache was not touched.
    for b, (n, c) in enumerate(zip(lengths, cached, strict=True)):
        for pos in range(c, n):
            slot = seqs.tables[b][pos // block_size] * block_size + pos % block_size
            assert torch.equal(seqs.cache.k[layer].view(-1, KV_HEADS, DIM)[slot], seqs.k[b][pos])
    assert not seqs.cache.k[0].any()


def decode_step(lengths: list[int], seed: int) -> tuple[Sequences, AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences whose last token is this step's decode: (them, the batch, q, k and v of the new tokens)."""
    seqs = Sequences(lengths, block_size=4, seed=seed)
    seqs.fill_prefix(0, [n - 1 for n in lengths])
    batch = build_attention_batch(seqs.table_tensor(), [1] * len(lengths), lengths, 4)
    q = torch.randn(len(lengths), HEADS, DIM, generator=seqs.gen)
    return seqs, batch, q, torch.stack([kk[-1] for kk in seqs.k]), torch.stack([vv[-1] for vv in seqs.v])


def assert_attends_like_naive(seqs: Sequences, q: torch.Tensor, out: torch.Tensor) -> None:
    for b in range(q.shape[0]):
        expected = naive_attention(q[b : b + 1], seqs.k[b], seqs.v[b], SPEC.scale)
        torch.testing.assert_close(out[b : b + 1], expected, atol=1e-5, rtol=1e-5)


def test_decode_groups_split_by_budget_give_the_same_result() -> None:
    seqs, batch, q, k, v = decode_step([5, 40, 9, 23, 2, 31], seed=3)
    seqs.backend.decode_group_tokens = 64  # forces several groups
    meta = seqs.backend.plan(batch)
    assert len(meta.decode_groups) > 2 and not meta.prefills
    assert_attends_like_naive(seqs, q, seqs.backend.forward(0, q, k, v, meta))


@pytest.mark.parametrize("lengths", [[17, 17, 17], [5, 40, 9]])
def test_one_group_of_every_row_attends_in_place(lengths: list[int]) -> None:
    """A step of decodes alone in one group: no gather of the queries nor scatter of the output, and on
    the CPU no mask at all when no sequence is padded (else -inf past each length, made once a step)."""
    seqs, batch, q, k, v = decode_step(lengths, seed=5)
    meta = seqs.backend.plan(batch)
    (group,) = meta.decode_groups
    assert group.whole and (group.additive is None) == (len(set(lengths)) == 1)
    assert_attends_like_naive(seqs, q, seqs.backend.forward(0, q, k, v, meta))


def test_bf16_decodes_match_dense_attention() -> None:
    """On the CPU bf16 decodes attend in float32 (SDPA's bf16 kernel is the slower there), in groups of
    at most CPU_DECODE_GROUP_TOKENS padded tokens."""
    lengths = [5, 40, 9, 23, 1]
    seqs = Sequences(lengths, block_size=4, seed=4, dtype=torch.bfloat16)
    assert seqs.backend.decode_group_tokens == CPU_DECODE_GROUP_TOKENS
    seqs.backend.decode_group_tokens = 48  # several groups
    seqs.fill_prefix(0, [n - 1 for n in lengths])
    batch = build_attention_batch(seqs.table_tensor(), [1] * len(lengths), lengths, 4)
    q = torch.randn(len(lengths), HEADS, DIM, generator=seqs.gen).to(torch.bfloat16)
    k = torch.stack([kk[-1] for kk in seqs.k])
    v = torch.stack([vv[-1] for vv in seqs.v])
    meta = seqs.backend.plan(batch)
    assert len(meta.decode_groups) > 1
    out = seqs.backend.forward(0, q, k, v, meta)
    assert out.dtype == torch.bfloat16
    for b in range(len(lengths)):
        expected = naive_attention(q[b : b + 1].float(), seqs.k[b].float(), seqs.v[b].float(), SPEC.scale)
        torch.testing.assert_close(out[b : b + 1].float(), expected, atol=2e-2, rtol=2e-2)


def test_multi_query_and_plain_multi_head() -> None:
    for kv_heads in (1, HEADS):
        spec = AttentionSpec(HEADS, kv_heads, DIM, 0.3)
        cache = KVCache(KVCacheSpec(1, kv_heads, DIM, torch.float32), 8, 4, torch.device("cpu"))
        backend = make_attention_backend("torch", cache, spec)
        batch = build_attention_batch(torch.tensor([[3, 1, 6]], dtype=torch.int32), [10], [10], 4)
        q, k, v = torch.randn(10, HEADS, DIM), torch.randn(10, kv_heads, DIM), torch.randn(10, kv_heads, DIM)
        out = backend.forward(0, q, k, v, backend.plan(batch))
        torch.testing.assert_close(out, naive_attention(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


def test_positions_and_slot_mapping() -> None:
    tables = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    batch = build_attention_batch(tables, [3, 1], [3, 10], block_size=4)
    assert batch.positions.tolist() == [0, 1, 2, 9]
    assert batch.slot_mapping.tolist() == [20, 21, 22, 3 * 4 + 1]
    assert batch.query_start_loc == [0, 3, 4] and batch.seq_lens_tensor.tolist() == [3, 10]


def test_bad_batches_and_backends_are_refused() -> None:
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="query_len"):
        build_attention_batch(tables, [5], [3], 4)
    cache = KVCache(KVCacheSpec(1, KV_HEADS, DIM, torch.float32), 2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="supported: torch"):
        make_attention_backend("flashinfer", cache, SPEC)
    with pytest.raises(ValueError, match="multiple"):
        make_attention_backend("torch", cache, AttentionSpec(3, KV_HEADS, DIM, 1.0))


@pytest.mark.parametrize(("n", "length"), [(1, 5), (3, 7), (4, 4)])
def test_cpu_lower_right_mask_is_torchs(n: int, length: int) -> None:
    from torch.nn.attention.bias import causal_lower_right

    got = lower_right_causal(n, length, torch.device("cpu"))
    assert got.dtype == torch.bool
    assert torch.equal(got, causal_lower_right(n, length)._materialize(torch.device("cpu")))


def test_cpu_worker_imports_no_triton_nor_dynamo() -> None:
    """torch._dynamo (with SymPy) and Triton cost a CPU worker 0.15 GB of RSS and serve it nothing."""
    code = (
        "import sys, torch\n"
        "import app.worker.process, app.worker.model_runner\n"
        "from app.worker.attention.torch_backend import CPU_DECODE_GROUP_TOKENS, lower_right_causal\n"
        "lower_right_causal(2, 5, torch.device('cpu'))\n"
        "loaded = [m for m in ('triton', 'torch._dynamo', 'sympy', 'tokenspeed_kernels.gemv') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
