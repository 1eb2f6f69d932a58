"""The portable reference backend: paged KV in plain torch ops. Runs on CPU and CUDA.

Planning (once per step) turns block tables into the KV slots each sequence reads, plus masks.
Sequences with several new tokens (prefill chunks) are attended one by one through SDPA (causal,
or masked when a cached prefix precedes the chunk); single-token ones (decodes) are gathered into
padded groups and attended together by two batched matmuls (on the CPU by SDPA in float32), each group
bounded in padded context tokens so a long tail cannot blow up the gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from app.worker.attention.base import AttentionBackend, AttentionBatch, AttentionMetadata, AttentionSpec
from app.worker.kv_cache import KVCache
from app.worker.layers.rotary import Rope
from app.worker.quantization.kv import write_kv

DEFAULT_DECODE_GROUP_TOKENS = 1 << 16
# On the CPU a group's gathered float32 K/V (~0.75 MiB for SmolLM2 at 1024 tokens) stays in the core's
# cache: 32 sequences of 140 tokens in groups of 1024 padded tokens attend 2.2x faster than in one.
CPU_DECODE_GROUP_TOKENS = 1 << 10


def lower_right_causal(n: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """The mask of n new tokens at the end of seq_len positions: token i sits at seq_len - n + i and sees
    every position up to it. On CUDA, torch's CausalBias, which SDPA's fused kernels apply without
    materialising [n, L]; on the CPU, SDPA would materialise it anyway, so a boolean [n, L] mask, and the
    CPU worker never imports torch.nn.attention.bias (it loads torch._dynamo, Triton and SymPy: 0.15 GB)."""
    if device.type == "cpu":
        return torch.ones(n, seq_len, dtype=torch.bool, device=device).tril(seq_len - n)
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n, seq_len)


@dataclass
class _PrefillPlan:
    start: int  # first new token row
    end: int
    ctx_slots: torch.Tensor  # [L] KV slots of the whole context
    mask: torch.Tensor | None  # causal aligned to the last query (a cached prefix precedes); None: plain causal


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [G] token rows (one new token per sequence)
    ctx_slots: torch.Tensor  # [G, Lmax] KV slots, padded
    padding: torch.Tensor  # [G, 1, 1, Lmax] bool: True past a sequence's length
    # The CPU's SDPA mask, made once a step rather than by SDPA in every layer: 0 where attended and
    # -inf past a sequence's length, float32 (the CPU attends in float32); None where no row is padded.
    additive: torch.Tensor | None
    whole: bool  # the group is every row of the step, in order: no gather of its queries, no scatter back


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    prefills: list[_PrefillPlan] = field(default_factory=list)
    decode_groups: list[_DecodeGroup] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_fp8_kv = True  # reads an FP8 cache with its per-layer scales

    def __init__(self, kv_cache: KVCache, spec: AttentionSpec, decode_group_tokens: int | None = None) -> None:
        super().__init__(kv_cache, spec)
        if decode_group_tokens is None:
            cpu = kv_cache.device.type == "cpu"
            decode_group_tokens = CPU_DECODE_GROUP_TOKENS if cpu else DEFAULT_DECODE_GROUP_TOKENS
        self.decode_group_tokens = decode_group_tokens

    def plan(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        meta = TorchAttentionMetadata(backend=self, batch=batch)
        decodes: list[int] = []
        for b, seq_len in enumerate(batch.seq_lens):
            start, end = batch.query_start_loc[b], batch.query_start_loc[b + 1]
            if end - start == 1:
                decodes.append(b)
            else:
                meta.prefills.append(self._plan_prefill(batch, b, start, end, seq_len))
        for group in self._group_decodes(decodes, batch.seq_lens):
            meta.decode_groups.append(self._plan_decode_group(batch, group))
        return meta

    def _context_slots(self, batch: AttentionBatch, rows: torch.Tensor, length: int) -> torch.Tensor:
        """KV slots of positions [0, length) for the sequences in `rows` -> [len(rows), length]."""
        pos = torch.arange(length, device=batch.block_tables.device)
        blocks = batch.block_tables[rows][:, pos // batch.block_size].to(torch.int64)
        return blocks * batch.block_size + pos % batch.block_size

    def _plan_prefill(
        self, batch: AttentionBatch, b: int, start: int, end: int, seq_len: int
    ) -> _PrefillPlan:
        device = batch.block_tables.device
        rows = torch.tensor([b], device=device)
        slots = self._context_slots(batch, rows, seq_len)[0]
        n = end - start
        mask = None if n == seq_len else lower_right_causal(n, seq_len, device)
        return _PrefillPlan(start, end, slots, mask)

    def _group_decodes(self, decodes: list[int], seq_lens: list[int]) -> list[list[int]]:
        """Split single-token sequences into groups of at most decode_group_tokens padded tokens
        (a group always takes at least one sequence)."""
        groups: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for b in decodes:
            grown = max(longest, seq_lens[b])
            if current and grown * (len(current) + 1) > self.decode_group_tokens:
                groups.append(current)
                current, grown = [], seq_lens[b]
            current.append(b)
            longest = grown
        if current:
            groups.append(current)
        return groups

    def _plan_decode_group(self, batch: AttentionBatch, group: list[int]) -> _DecodeGroup:
        device = batch.block_tables.device
        idx = torch.tensor(group, device=device)
        lens = batch.seq_lens_tensor.index_select(0, idx)
        longest = max(batch.seq_lens[b] for b in group)
        slots = self._context_slots(batch, idx, longest)
        padding = torch.arange(longest, device=device).unsqueeze(0) >= lens.unsqueeze(1)
        starts = [batch.query_start_loc[b] for b in group]
        rows = torch.tensor(starts, device=device)
        padding = padding[:, None, None, :]
        additive = None
        if device.type == "cpu" and any(batch.seq_lens[b] != longest for b in group):
            additive = torch.zeros(padding.shape, device=device).masked_fill_(padding, float("-inf"))
        whole = starts == list(range(batch.query_start_loc[-1]))
        return _DecodeGroup(rows, slots, padding, additive, whole)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata)
        if rope is not None:
            q, k = rope.apply(q, k)
        k_cache = self.kv_cache.k[layer_idx].view(-1, self.spec.num_kv_heads, self.spec.head_dim)
        v_cache = self.kv_cache.v[layer_idx].view(-1, self.spec.num_kv_heads, self.spec.head_dim)
        k_scale, v_scale = self.kv_cache.k_scales[layer_idx], self.kv_cache.v_scales[layer_idx]
        write_kv(k_cache, meta.batch.slot_mapping, k, k_scale)
        write_kv(v_cache, meta.batch.slot_mapping, v, v_scale)
        # An FP8 cache is read as cast codes and dequantized by folding its scales in, exactly:
        # q . (K * k_scale) == (q * k_scale) . K and softmax(s) @ (V * v_scale) == (softmax(s) @ V) * v_scale.
        if k_scale != 1.0:
            q = q * k_scale
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].whole and q.shape[0] == groups[0].rows.numel():  # decodes alone
            out = self._attend_decodes(q, k_cache, v_cache, groups[0])
            return out if v_scale == 1.0 else out * v_scale
        out = torch.empty_like(q)
        for p in meta.prefills:
            out[p.start : p.end] = self._attend_prefill(q[p.start : p.end], k_cache, v_cache, p)
        for g in meta.decode_groups:
            out.index_copy_(0, g.rows, self._attend_decodes(q.index_select(0, g.rows), k_cache, v_cache, g))
        return out if v_scale == 1.0 else out * v_scale

    def _expand_kv(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Repeat each KV head for its group of query heads (GQA): query head h reads KV head h // group."""
        group = self.spec.num_heads // self.spec.num_kv_heads
        return x if group == 1 else x.repeat_interleave(group, dim=dim)

    def _attend_prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: _PrefillPlan
    ) -> torch.Tensor:
        # 4-D [1, H, n, D] inputs: SDPA's flash / memory-efficient kernels take no 3-D ones, and the
        # math fallback would materialise the [H, n, L] scores.
        keys = self._expand_kv(k_cache.index_select(0, p.ctx_slots), 1).transpose(0, 1).unsqueeze(0)
        values = self._expand_kv(v_cache.index_select(0, p.ctx_slots), 1).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=self.spec.scale,
        )
        return out[0].transpose(0, 1)

    def _attend_decodes(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _DecodeGroup
    ) -> torch.Tensor:
        """One query per sequence: two batched matmuls with a float32 softmax (as transformers' eager
        attention does), KV heads broadcast over their query-head group instead of repeated. On the
        CPU, SDPA's fused kernel instead (GQA in place, no permuted copies of the gathered context):
        1.7-2.6x faster there for SmolLM2's shapes at 1 to 8 sequences, and what transformers' default
        (sdpa) attention runs. Always in float32 there: its bf16 kernel took 2-3x as long, gathered
        context included, as upcasting the bf16 context and running the float32 one."""
        num_seqs, num_kv, dim = q.shape[0], self.spec.num_kv_heads, self.spec.head_dim
        cpu = q.device.type == "cpu"
        # index_select over the flattened slots: 1.7-2.7x faster on the CPU than indexing by the [G, L]
        # tensor (which took 13% of a 32-sequence step there).
        flat, shape = g.ctx_slots.view(-1), (*g.ctx_slots.shape, num_kv, dim)
        dtype = torch.float32 if cpu else q.dtype
        keys = k_cache.index_select(0, flat).view(shape).to(dtype)  # [G, L, Hkv, D]
        values = v_cache.index_select(0, flat).view(shape).to(dtype)
        if cpu:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2).to(dtype), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=g.additive,
                scale=self.spec.scale, enable_gqa=True,
            )  # [G, Hq, 1, D]
            return out.squeeze(2).to(q.dtype)
        grouped = q.view(num_seqs, num_kv, -1, dim)  # query head h reads KV head h // group
        scores = torch.einsum("bhgd,blhd->bhgl", grouped, keys).float() * self.spec.scale
        scores = scores.masked_fill(g.padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.einsum("bhgl,blhd->bhgd", probs, values)
        return out.reshape(num_seqs, -1, dim)
