"""The triton attention backend (kernels under the interpreter) against the torch backend, the piecewise
graphs' cut through its forward, and the model runner on it against transformers' greedy generate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from app.worker.attention import build_attention_batch, make_attention_backend
from app.worker.attention.base import AttentionSpec, MixedMetadata
from app.worker.attention.triton_backend import TritonAttentionBackend
from app.worker.kv_cache import KVCache, KVCacheSpec
from app.worker.model_runner import ModelRunner
from app.worker.piecewise_graphs import PiecewiseGraphs
from app.worker.quantization.calibrate import load_model
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
    ("query_lens", "seq_lens", "decode_tokens"),
    [([1, 1, 1], [5, 40, 17], None), ([9, 1, 3, 1], [9, 12, 30, 2], None), ([1, 1, 9, 3], [12, 40, 9, 30], 2)],
)
def test_triton_backend_matches_torch_backend(
    query_lens: list[int], seq_lens: list[int], decode_tokens: int | None
) -> None:
    """Decodes, prefill chunks with a decode among them (one prefill launch), and a mixed step whose
    leading decodes run the decode kernel (decode_tokens of them) and the rest the prefill kernel."""
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
    assert (meta.decode_tokens if isinstance(meta, MixedMetadata) else None) == decode_tokens
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


def test_graph_pieces_cut_the_backends_own_forward(tmp_path: Path) -> None:
    """Capturing a bucket's pieces runs the backend's forward with its attention cut out (here the
    warm-up pass: no CUDA, no graphs). One cut a layer; layer 0's K/V land in the step's slots exactly
    as an eager forward writes them, the pad rows' in the scratch slot, nothing elsewhere. A backend
    whose forward stopped ending in `attend`, or a cut that wrote elsewhere, fails here."""
    model_dir = build_tiny_model("llama", tmp_path, seed=3, num_hidden_layers=2)
    model = load_model(model_dir, CPU, "float32", max_positions=64)
    block_size, tokens, scratch = 4, 11, 0  # block 0 holds the scratch slot; the step's table avoids it
    table = torch.tensor([[2, 5, 1, 7]], dtype=torch.int32)
    batch = build_attention_batch(table, [tokens], [tokens], block_size)
    ids = torch.randint(0, model.dims.vocab_size, (tokens,), generator=torch.Generator().manual_seed(4))
    caches = [KVCache(model.kv_cache_spec(model.dtype), 8, block_size, CPU) for _ in range(2)]
    eager, cut = (TritonAttentionBackend(cache, model.attention_spec) for cache in caches)
    with torch.no_grad():
        model(ids, batch.positions, eager.plan(batch))
        pieces = PiecewiseGraphs(model, cut, [16], scratch, model.dims.hidden, CPU)
        size = pieces.stage(ids, batch)
        pieces.input_ids[tokens:size] = 5  # pad rows keep an earlier step's ids: not token 0 (zero embedding)
        captured = pieces._forward(size, None)
    assert size == 16 and captured.layers == [0, 1] and captured.graphs == []
    assert "attend" not in vars(cut)  # the backend's own attend again
    written = torch.cat([batch.slot_mapping, torch.tensor([scratch])])
    for ours, theirs in ((caches[1].k[0], caches[0].k[0]), (caches[1].v[0], caches[0].v[0])):
        flat, expected = ours.flatten(0, 1), theirs.flatten(0, 1)
        assert torch.equal(flat[batch.slot_mapping], expected[batch.slot_mapping])
        assert flat[scratch].abs().sum() > 0
        others = torch.ones(flat.shape[0], dtype=torch.bool)
        others[written] = False
        assert not flat[others].any()


@pytest.mark.slow  # a model through the interpreter
def test_runner_on_triton_backend_matches_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_model("qwen3", tmp_path, seed=2, num_hidden_layers=2)
    runner = ModelRunner(make_settings(model_dir, attention_backend="triton", max_num_seqs=3), CPU)
    assert runner.ready_message().info.attention_backend == runner.ready_message().info.decode_kernel == "triton"
    prompts = prompts_for(runner.vocab_size, [5, 21])
    sched = ScriptedScheduler(runner)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=8, join_step=2 * i))
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(model_dir, prompt, 8), f"r{i}"
