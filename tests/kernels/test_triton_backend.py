"""The triton attention backend (kernels under the interpreter) against the torch backend, and the
model runner on it against transformers' greedy generate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from app.worker.attention import build_attention_batch, make_attention_backend
from app.worker.attention.base import AttentionSpec
from app.worker.attention.triton_backend import TritonAttentionBackend
from app.worker.kv_cache import KVCache, KVCacheSpec
from app.worker.model_runner import ModelRunner
from tests.support.model_factory import build_tiny_model
from tests.unit.test_model_runner import Request, ScriptedScheduler, hf_greedy, make_settings, prompts_for

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
CPU = torch.device("cpu")


def twin_caches(num_blocks: int, block_size: int, seed: int) -> tuple[KVCache, KVCache]:
    spec = KVCacheSpec(1, SPEC.num_kv_heads, SPEC.head_dim, torch.float32)
    a, b = KVCache(spec, num_blocks, block_size, CPU), KVCache(spec, num_blocks, block_size, CPU)
    gen = torch.Generator().manual_seed(seed)
    for x, y in ((a.k[0], b.k[0]), (a.v[0], b.v[0])):
        x.copy_(torch.randn(x.shape, generator=gen))
        y.copy_(x)
    return a, b


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"), [([1, 1, 1], [5, 40, 17]), ([1, 9, 3, 1], [12, 9, 30, 2])]
)
def test_triton_backend_matches_torch_backend(query_lens: list[int], seq_lens: list[int]) -> None:
    block_size = 4
    width = max(math.ceil(n / block_size) for n in seq_lens)
    tables = torch.randperm(len(seq_lens) * width, generator=torch.Generator().manual_seed(1)).int()
    tables = tables.view(len(seq_lens), width)
    ours, ref = twin_caches(len(seq_lens) * width, block_size, seed=2)
    triton_backend = make_attention_backend("triton", ours, SPEC)
    torch_backend = make_attention_backend("torch", ref, SPEC)
    assert isinstance(triton_backend, TritonAttentionBackend)
    batch = build_attention_batch(tables, query_lens, seq_lens, block_size)
    gen = torch.Generator().manual_seed(3)
    n = batch.num_tokens
    q = torch.randn(n, 4, 16, generator=gen)
    k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    meta = triton_backend.plan(batch)
    out = triton_backend.forward(0, q, k, v, meta)
    expected = torch_backend.forward(0, q, k, v, torch_backend.plan(batch))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.k[0], ref.k[0]) and torch.equal(ours.v[0], ref.v[0])  # same KV writes
    # attend alone (the piecewise graphs' call), into a given buffer: the same output
    buffer = torch.full((n + 2, 4, 16), float("nan"))
    assert triton_backend.attend(0, q, meta, out=buffer[:n]).data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:n], out) and buffer[n:].isnan().all()


def test_capture_metadata_splits_for_the_longest_context() -> None:
    cache, _ = twin_caches(64, 4, seed=0)
    backend = TritonAttentionBackend(cache, SPEC)
    tables = torch.zeros(2, 64, dtype=torch.int32)
    batch = build_attention_batch(tables, [1, 1], [1, 1], 4)
    meta = backend.capture_metadata(batch)
    assert meta.decode and meta.num_splits == backend._splits(2, 256)


def test_runner_on_triton_backend_matches_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_model("qwen3", tmp_path, seed=2, num_hidden_layers=2)
    runner = ModelRunner(make_settings(model_dir, attention_backend="triton", max_num_seqs=3), CPU)
    assert runner.ready_message().info["attention_backend"] == runner.ready_message().info["decode_kernel"] == "triton"
    prompts = prompts_for(runner.vocab_size, [5, 21])
    sched = ScriptedScheduler(runner)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=8, join_step=2 * i))
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, 8), f"r{i}"
