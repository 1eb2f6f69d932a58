"""Attention backend selection, CUDA-graph capture sizes and the graph input staging (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from app.worker.attention import resolve_attention_backend
from app.worker.attention.base import AttentionSpec, build_attention_batch
from app.worker.cuda_graphs import DecodeGraphs, capture_sizes
from app.worker.kv_cache import KVCache, KVCacheSpec
from app.worker.piecewise_graphs import PiecewiseGraphs, bucket_sizes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_default_backend_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.worker.attention.flashinfer_backend as fi

    assert resolve_attention_backend(None, CPU, torch.bfloat16, 128) == "torch"
    monkeypatch.setattr(fi, "flashinfer_available", lambda: True)
    assert resolve_attention_backend(None, CUDA, torch.bfloat16, 128) == "flashinfer"
    assert resolve_attention_backend(None, CUDA, torch.bfloat16, 16) == "triton"  # not a flashinfer size
    assert resolve_attention_backend(None, CUDA, torch.float32, 128) == "triton"  # flashinfer has no fp32
    assert resolve_attention_backend(None, CUDA, torch.float8_e4m3fn, 128) == "torch"
    monkeypatch.setattr(fi, "flashinfer_available", lambda: False)
    assert resolve_attention_backend(None, CUDA, torch.bfloat16, 128) == "triton"


def test_explicit_backends_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name in ("triton", "flashinfer", "fa3"):
        with pytest.raises(ValueError, match="not available on cpu; supported: torch"):
            resolve_attention_backend(name, CPU, torch.float32)
    assert resolve_attention_backend("torch", CPU, torch.float32) == "torch"
    assert resolve_attention_backend("flashinfer", CUDA, torch.bfloat16) == "flashinfer"
    with pytest.raises(ValueError, match="supported: flashinfer, torch, triton"):
        resolve_attention_backend("mha", CUDA, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel tests run triton on the CPU this way
    assert resolve_attention_backend("triton", CPU, torch.float32) == "triton"


def test_flashinfer_backend_refuses_the_cpu_and_float32() -> None:
    from app.worker.attention.flashinfer_backend import FlashInferAttentionBackend

    cache = KVCache(KVCacheSpec(1, 2, 16, torch.float32), 4, 4, CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        FlashInferAttentionBackend(cache, AttentionSpec(4, 2, 16, 0.25))


def test_flashinfer_decode_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton for a 16-bit cache; for an FP8 one xqa where it runs (Hopper, blocks of 16 to 128 tokens,
    head sizes a multiple of 16 up to 256), else flashinfer's FA2 tensor-core decode."""
    import app.worker.attention.flashinfer_backend as fi

    fp8 = torch.float8_e4m3fn
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fi.default_decode_kernel(torch.bfloat16, CUDA, 16, 128) == "triton"
    assert fi.default_decode_kernel(fp8, CUDA, 16, 128) == "xqa"
    assert fi.default_decode_kernel(fp8, CUDA, 256, 128) == "tensor_cores"  # a block xqa is not built for
    assert "--block-size" in (fi.xqa_unsupported(CUDA, 8, 128) or "")
    assert fi.xqa_unsupported(CUDA, 128, 72) is not None  # not a multiple of 16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert fi.default_decode_kernel(fp8, CUDA, 16, 128) == "tensor_cores"
    assert "compute capability 9.x" in (fi.xqa_unsupported(CUDA, 16, 128) or "")


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 256])
def test_flashinfer_probe_covers_its_sequences_at_any_block_size(block_size: int) -> None:
    """The start-up probe runs at the runner's block size (xqa builds a kernel per block size); its
    block tables must cover its sequences whatever that size."""
    from app.worker.attention.flashinfer_backend import PROBE_SEQ_LENS, probe_batches

    num_blocks, (decode, prefill) = probe_batches(block_size, CPU)
    assert num_blocks * block_size >= sum(PROBE_SEQ_LENS)
    assert decode.num_tokens == 2 and prefill.num_tokens == 23
    assert int(decode.block_tables.max()) < num_blocks and decode.block_size == block_size


def test_capture_sizes() -> None:
    assert capture_sizes(None, None, 160) == [1, 2, 4, 8, *range(16, 161, 8)]
    assert capture_sizes(None, None, 1000) == [1, 2, 4, 8, *range(16, 257, 8), *range(272, 513, 16)]
    assert capture_sizes(None, None, 300) == [1, 2, 4, 8, *range(16, 257, 8), 272, 288, 300]
    assert capture_sizes(None, 20, 160) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(None, None, 3) == [1, 2, 3]
    assert capture_sizes([8, 1, 4, 4, 64], None, 32) == [1, 4, 8]  # deduplicated, capped by max_num_seqs
    assert capture_sizes([1, 2, 16], 8, 32) == [1, 2]
    with pytest.raises(ValueError, match="positive"):
        capture_sizes([0, 4], None, 32)


class _Unused:
    """Stands in for the model and backend: staging touches neither (the graphs read the model's dtype,
    their logits buffer's)."""

    dtype = torch.float32

def test_decode_graphs_hold_every_verify_row() -> None:
    """While speculating, a sequence verifying k drafts feeds k + 1 graph rows: the sizes reach
    max_num_seqs x (k + 1)."""
    from app.worker.graph_capture import decode_graph_sizes
    from tests.support.settings import make_settings

    cuda = torch.device("cuda")  # the device type alone decides; nothing runs on it
    assert decode_graph_sizes(make_settings(max_num_seqs=2), cuda, "triton", 2) == [1, 2]
    spec = make_settings(max_num_seqs=2, speculative_algorithm="NGRAM", speculative_num_steps=3)
    assert decode_graph_sizes(spec, cuda, "triton", 2) == [1, 2, 4, 8]
    assert decode_graph_sizes(spec, CPU, "triton", 2) == []



def test_stage_fills_rows_and_pads_onto_the_scratch_block() -> None:
    graphs = DecodeGraphs(_Unused(), _Unused(), [1, 4, 8], max_blocks=3, block_size=4, scratch_block=9,
                          vocab_size=5, device=CPU)  # fmt: skip
    tables = torch.tensor([[0, 0, 0], [5, 6, 7], [1, 2, 0]], dtype=torch.int32)  # per slot
    last = torch.tensor([10, 11, 12])
    size = graphs.stage([2, 1], [6, 9], tables, last)
    graphs.locate(size)  # inside the graph, at replay
    assert size == 4 and graphs.size_for(9) is None
    assert graphs.input_ids[:4].tolist() == [12, 11, 0, 0]
    assert graphs.positions[:4].tolist() == [5, 8, 0, 0]
    assert graphs.seq_lens[:4].tolist() == [6, 9, 1, 1]
    assert graphs.block_tables[:2].tolist() == [[1, 2, 0], [5, 6, 7]]
    assert graphs.block_tables[2:4, 0].tolist() == [9, 9]
    assert graphs.slot_mapping[:4].tolist() == [2 * 4 + 1, 7 * 4 + 0, 36, 36]
    # A smaller step after a larger one: stale rows beyond it are re-padded.
    graphs.stage([1, 2, 0, 1][:3], [3, 3, 3], tables, last)
    assert graphs.block_tables[3, 0] == 9 and graphs.seq_lens[3] == 1 and graphs.input_ids[3] == 0


def test_stage_lays_a_verify_row_out_as_one_row_per_position() -> None:
    """Slot 1 feeds its last token and two drafts at positions 4..6 (context lengths 5..7): three rows of
    one block table, each with its own position and KV slot, the tokens as given."""
    graphs = DecodeGraphs(_Unused(), _Unused(), [4], max_blocks=3, block_size=4, scratch_block=9,
                          vocab_size=5, device=CPU)  # fmt: skip
    tables = torch.tensor([[0, 0, 0], [5, 6, 7]], dtype=torch.int32)
    size = graphs.stage([1, 1, 1], [5, 6, 7], tables, torch.zeros(2, dtype=torch.int64),
                        input_ids=torch.tensor([21, 22, 23]))
    graphs.locate(size)
    assert graphs.input_ids[:4].tolist() == [21, 22, 23, 0]
    assert graphs.positions[:3].tolist() == [4, 5, 6]
    assert graphs.slot_mapping[:4].tolist() == [6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 36]


def test_a_batch_split_attends_like_the_whole() -> None:
    """split_batch's two parts, run one after the other, give the whole batch's output (each row attends
    over its own context only); leading_single_token_rows counts the decodes a step starts with."""
    from app.worker.attention import AttentionSpec, build_attention_batch
    from app.worker.attention.base import leading_single_token_rows, split_batch
    from app.worker.attention.torch_backend import TorchAttentionBackend
    from app.worker.kv_cache import KVCache, KVCacheSpec

    gen = torch.Generator().manual_seed(0)
    spec = AttentionSpec(4, 2, 16, 0.25)
    tables = torch.randperm(40, generator=gen).int().view(4, 10)
    query_lens, seq_lens = [1, 1, 9, 1], [30, 12, 20, 7]
    batch = build_attention_batch(tables, query_lens, seq_lens, 4)
    assert leading_single_token_rows(batch) == 2
    assert leading_single_token_rows(build_attention_batch(tables, [1] * 4, seq_lens, 4)) == 4
    q = torch.randn(12, 4, 16, generator=gen)
    k, v = torch.randn(12, 2, 16, generator=gen), torch.randn(12, 2, 16, generator=gen)
    outputs = []
    for parts in ([batch], split_batch(batch, 2)):
        cache = KVCache(KVCacheSpec(1, 2, 16, torch.float32), 41, 4, torch.device("cpu"))
        cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=torch.Generator().manual_seed(1)))
        cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=torch.Generator().manual_seed(2)))
        backend, out, start = TorchAttentionBackend(cache, spec), [], 0
        for part in parts:
            end = start + part.num_tokens
            out.append(backend.forward(0, q[start:end], k[start:end], v[start:end], backend.plan(part)))
            start = end
        outputs.append(torch.cat(out))
    head, tail = split_batch(batch, 2)
    assert (head.query_start_loc, tail.query_start_loc) == ([0, 1, 2], [0, 9, 10])
    assert tail.seq_lens == [20, 7] and torch.equal(tail.slot_mapping, batch.slot_mapping[2:])
    torch.testing.assert_close(outputs[1], outputs[0])


def test_piecewise_buckets_cover_every_step_size() -> None:
    assert bucket_sizes(0) == []
    assert bucket_sizes(1) == [16]
    assert bucket_sizes(300) == [16, 32, 64, 96, 128, 192, 256, 320]
    assert bucket_sizes(8192)[-1] == 8192 and bucket_sizes(2048)[-1] == 2048
    for limit in (1, 17, 300, 512, 513, 2000):
        sizes = bucket_sizes(limit)
        assert sizes == sorted(set(sizes)) and sizes[-1] >= limit
        bucket = {t: next(b for b in sizes if b >= t) for t in range(1, limit + 1)}
        assert all(b <= max(16, 2 * t) for t, b in bucket.items())  # small steps read weights: padding is cheap
        assert all(b <= 1.25 * t for t, b in bucket.items() if t >= 512)


def test_piecewise_stage_pads_onto_the_scratch_slot() -> None:
    model, backend = _Unused(), _Unused()
    model.dtype = torch.float32
    backend.supports_piecewise_graphs = True
    backend.spec = AttentionSpec(4, 2, 8, 0.5)
    pieces = PiecewiseGraphs(model, backend, [4, 8], scratch_slot=99, hidden_size=16, device=CPU)
    table = torch.tensor([[3, 4]], dtype=torch.int32)
    long = build_attention_batch(table, [7], [7], 4)
    assert pieces.stage(torch.arange(7), long) == 8
    assert pieces.slot_mapping.tolist() == [12, 13, 14, 15, 16, 17, 18, 99]
    short = build_attention_batch(table, [3], [5], 4)  # 2 cached tokens, 3 new
    assert pieces.stage(torch.tensor([7, 8, 9]), short) == 4
    assert pieces.slot_mapping[:4].tolist() == [14, 15, 16, 99]  # the long step's row 3 is padding now
    assert pieces.positions[:3].tolist() == [2, 3, 4] and pieces.input_ids[:3].tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
        pieces.stage(torch.arange(9), build_attention_batch(torch.tensor([[0, 1, 2]], dtype=torch.int32), [9], [9], 4))
