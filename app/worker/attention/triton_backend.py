"""The Triton backend: paged-KV kernels from tokenspeed_kernels, on CUDA (or on the CPU under
TRITON_INTERPRET=1, which is how the tests run it without a GPU).

A step whose sequences all feed one token runs the split-K decode kernel, a step of prefill chunks the
prefill/extend kernel, and a mixed step both: its leading one-token rows on the decode kernel, the rest
on the prefill kernel (MixedMetadata). The new K/V rows go into the cache first, through the fused
write kernel (which also applies the rotary embedding on CUDA), so both kernels read the whole context
from the cache. Decode metadata holds only device tensors of the batch and a split count fixed per
batch size, so decode steps are CUDA-graph safe.

An FP8 KV cache (float8_e4m3fn, per-layer scales) is written and read by the same kernels: the write
quantizes with the layer's k_scale / v_scale, the attention kernels cast the tiles to the query's
dtype and fold the scales in (Python floats, so a captured graph keeps them as constants). Triton's
e4m3 type needs compute capability 8.9 or newer (Ada, Hopper).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from app.worker.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    AttentionSpec,
    MixedMetadata,
)
from app.worker.kv_cache import KVCache
from app.worker.layers.fused import kernel_module
from app.worker.layers.rotary import Rope
from app.worker.transfer import upload

# SM count assumed off-GPU (the interpreter): it only shapes the split count.
_INTERPRETER_SMS = 4
# Model dtypes the kernels run (the query and output have it; so has the KV cache unless it is FP8).
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)


def triton_usable(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    decode: bool = True
    num_splits: int = 1  # decode: context pieces per sequence
    cu_seqlens_q: torch.Tensor | None = None  # prefill: [B+1] int32 on the device
    max_query_len: int = 1


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_fp8_kv = True  # reads an FP8 cache with its per-layer scales
    supports_piecewise_graphs = True

    def __init__(self, kv_cache: KVCache, spec: AttentionSpec) -> None:
        super().__init__(kv_cache, spec)
        device = kv_cache.k[0].device
        if not triton_usable(device):
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1)")
        if kv_cache.spec.dtype not in (*TRITON_DTYPES, FP8_KV_DTYPE):
            raise ValueError(f"the triton attention backend does not read a {kv_cache.spec.dtype} KV cache")
        if (
            kv_cache.spec.dtype == FP8_KV_DTYPE
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY
        ):
            raise ValueError(
                "the triton attention backend reads an FP8 KV cache on compute capability 8.9 or newer "
                f"(Ada, Hopper), not {torch.cuda.get_device_capability(device)}; use --attention-backend torch"
            )
        # Imported here: the interpreter switch is read when the kernels are defined.
        from tokenspeed_kernels import decode_attention, prefill_attention

        self._decode = decode_attention
        self._prefill = prefill_attention
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else _INTERPRETER_SMS
        )

    def _splits(self, batch_size: int, max_seq_len: int) -> int:
        return self._decode.choose_num_splits(batch_size, self.spec.num_kv_heads, max_seq_len, self.num_sms)

    def plan(self, batch: AttentionBatch) -> AttentionMetadata:
        return self.plan_decodes_and_prefills(batch, self.capture_metadata, self._plan_prefill)

    def _plan_prefill(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        starts = batch.query_start_loc
        max_query_len = max(hi - lo for lo, hi in zip(starts, starts[1:], strict=False))
        cu = upload(starts, torch.int32, batch.block_tables.device)
        return TritonAttentionMetadata(
            backend=self, batch=batch, decode=False, cu_seqlens_q=cu, max_query_len=max_query_len
        )

    def capture_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        # Split for the longest context the block tables can describe; shorter sequences leave
        # trailing pieces empty, which cost one early-exiting program each. Eager decode steps split
        # the same way, so a graph replay and an eager step of one batch compute the same sums.
        longest = batch.block_tables.shape[1] * batch.block_size
        return TritonAttentionMetadata(
            backend=self, batch=batch, num_splits=self._splits(batch.num_seqs, longest)
        )

    def prepare_replay(self, meta: AttentionMetadata, batch: AttentionBatch) -> None:
        """The kernels read the persistent buffers directly: nothing to refresh."""

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        # No check of meta's type here: capturing piecewise graphs runs this forward with the cutter's
        # metadata (app/worker/piecewise_graphs.py), whose `attend` stands in for this one.
        q = write_new_tokens(self.kv_cache, layer_idx, q, k, v, meta.batch.slot_mapping, rope)
        return self.attend(layer_idx, q, meta)  # type: ignore[arg-type]

    def attend(
        self, layer_idx: int, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The attention alone, over a cache that already holds the step's K/V."""
        if isinstance(meta, MixedMetadata):
            return self.attend_mixed(layer_idx, q, meta, out)
        assert isinstance(meta, TritonAttentionMetadata)
        batch = meta.batch
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        scales = {"k_scale": self.kv_cache.k_scales[layer_idx], "v_scale": self.kv_cache.v_scales[layer_idx]}
        if meta.decode:
            return self._decode.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.seq_lens_tensor,
                self.spec.scale,
                meta.num_splits,
                out=out,
                **scales,
            )
        assert meta.cu_seqlens_q is not None
        return self._prefill.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            meta.cu_seqlens_q,
            batch.seq_lens_tensor,
            meta.max_query_len,
            self.spec.scale,
            out=out,
            **scales,
        )


def write_new_tokens(
    kv_cache: KVCache,
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope: Rope | None,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k (when rope is given) and write k and v into the layer's cache slots; returns q
    rotated: in place, or in q_out (a contiguous [T, heads, dim] buffer for kernels that need one). One
    kernel where the rope runs fused (CUDA), the torch rotation then the write elsewhere."""
    caches = (kv_cache.k[layer_idx], kv_cache.v[layer_idx], slot_mapping)
    scales = (kv_cache.k_scales[layer_idx], kv_cache.v_scales[layer_idx])
    if rope is not None and rope.fused:
        kernel_module("rotary").rotate_and_write_kv(
            q, k, v, rope.rotary.cos, rope.rotary.sin, rope.positions, *caches, *scales, q_out=q_out,
            qk_norm=rope.kernel_qk_norm(),
        )
        return q if q_out is None else q_out
    if rope is not None:
        q, k = rope.apply(q, k)
    kernel_module("kv_write").write_kv(k, v, *caches, *scales)
    return q if q_out is None else q_out.copy_(q)
