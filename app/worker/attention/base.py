"""The attention backend interface.

Once per step the runner describes the batch (an AttentionBatch: flat varlen tokens, each
sequence's context length and block table) and the backend plans it (`plan`), returning metadata
that every layer shares. Each layer then calls `backend.forward(layer_idx, q, k, v, meta, rope)`, which
applies the rotary embedding to q and k (on CUDA in the same kernel as the KV write), writes the new
tokens' K/V into the paged cache and attends each sequence's new queries over its whole context
(cached prefix + new tokens, causal among the new ones).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from app.worker.kv_cache import KVCache
from app.worker.transfer import to_device, upload

if TYPE_CHECKING:
    from app.worker.layers.rotary import Rope


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    # The query's (and output's) dtype, the model's. None: the KV cache's, which is right for any cache
    # but an FP8 one; a backend that plans for the query dtype ahead of forward (flashinfer) needs it set
    # to read an FP8 cache.
    q_dtype: torch.dtype | None = None


@dataclass
class AttentionBatch:
    """One step's tokens, backend-agnostic. Sequence b owns new tokens
    query_start_loc[b]:query_start_loc[b+1] and has seq_lens[b] tokens of context after the step."""

    query_start_loc: list[int]  # [B+1], host
    seq_lens: list[int]  # [B], host
    seq_lens_tensor: torch.Tensor  # [B] int32, device
    block_tables: torch.Tensor  # [B, max_blocks] int32, device
    positions: torch.Tensor  # [T] int64, device
    slot_mapping: torch.Tensor  # [T] int64, device: KV slot of each new token
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def build_attention_batch(
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    seq_lens_tensor: torch.Tensor | None = None,
) -> AttentionBatch:
    """Positions and KV slots of the new tokens: each sequence's new tokens are its last
    query_lens[b] positions. block_tables must cover every position below seq_lens[b];
    seq_lens_tensor is seq_lens already on the device, if the caller keeps it there."""
    if len(query_lens) != len(seq_lens) or block_tables.shape[0] != len(seq_lens):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    device = block_tables.device
    qlens = torch.tensor(query_lens, dtype=torch.int64)
    context = torch.tensor(seq_lens, dtype=torch.int64) - qlens
    if bool((context < 0).any()) or bool((qlens < 1).any()):
        raise ValueError("every sequence needs 1 <= query_len <= seq_len")
    starts = torch.cumsum(qlens, 0) - qlens
    row = torch.repeat_interleave(torch.arange(len(query_lens)), qlens)
    positions = torch.arange(int(qlens.sum())) - starts[row] + context[row]
    positions = to_device(positions, device)  # no wait for the step in flight (transfer.py)
    row = to_device(row, device)
    blocks = block_tables[row, positions // block_size].to(torch.int64)
    query_start_loc = [0, *torch.cumsum(qlens, 0).tolist()]
    return AttentionBatch(
        query_start_loc=query_start_loc,
        seq_lens=list(seq_lens),
        seq_lens_tensor=seq_lens_tensor if seq_lens_tensor is not None else upload(seq_lens, torch.int32, device),
        block_tables=block_tables,
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        block_size=block_size,
    )


def leading_single_token_rows(batch: AttentionBatch) -> int:
    """How many sequences at the front of the batch feed one token each (decodes come first in a step)."""
    starts = batch.query_start_loc
    for row, (lo, hi) in enumerate(zip(starts, starts[1:], strict=False)):
        if hi - lo != 1:
            return row
    return batch.num_seqs


def split_batch(batch: AttentionBatch, rows: int) -> tuple[AttentionBatch, AttentionBatch]:
    """The first `rows` sequences and the others, as two batches over the same cache."""
    tokens = batch.query_start_loc[rows]

    def part(seqs: slice, toks: slice, starts: list[int]) -> AttentionBatch:
        return AttentionBatch(
            query_start_loc=starts, seq_lens=batch.seq_lens[seqs], seq_lens_tensor=batch.seq_lens_tensor[seqs],
            block_tables=batch.block_tables[seqs], positions=batch.positions[toks],
            slot_mapping=batch.slot_mapping[toks], block_size=batch.block_size,
        )  # fmt: skip

    head = part(slice(None, rows), slice(None, tokens), batch.query_start_loc[: rows + 1])
    tail = part(slice(rows, None), slice(tokens, None), [s - tokens for s in batch.query_start_loc[rows:]])
    return head, tail


@dataclass
class AttentionMetadata:
    """A planned step; backends subclass it with what they precompute once for all layers."""

    backend: AttentionBackend
    batch: AttentionBatch


@dataclass
class MixedMetadata(AttentionMetadata):
    """A step with decodes and prefill chunks: its leading one-token rows (the decodes: the scheduler
    puts them first) run the backend's decode kernel, the rest its prefill kernel. One prefill launch over
    both would read the decodes' contexts with the prefill kernel, at a fraction of the decode kernel's
    rate (a tile of query rows holding one, a context read once per query head)."""

    decode: AttentionMetadata  # of the first decode_tokens tokens
    prefill: AttentionMetadata
    decode_tokens: int


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether decode steps can be captured in CUDA graphs (capture_metadata / prepare_replay below).
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether it reads an FP8 (float8_e4m3fn) KV cache with the cache's per-layer k/v scales; the
    # runner's default backend falls back to torch for one that does not (quantization.fp8_kv_backend).
    supports_fp8_kv: ClassVar[bool] = False
    # Whether forward writes the new K/V at meta.batch.slot_mapping (write_new_tokens, triton_backend), then
    # returns self.attend(layer_idx, q, meta): graph pieces run forward with attend cut out, and the
    # backend attends between them (app/worker/piecewise_graphs.py).
    supports_piecewise_graphs: ClassVar[bool] = False

    def __init__(self, kv_cache: KVCache, spec: AttentionSpec) -> None:
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
            )
        if kv_cache.spec.num_kv_heads != spec.num_kv_heads or kv_cache.spec.head_dim != spec.head_dim:
            raise ValueError("the KV cache's head layout does not match the attention spec")
        self.kv_cache = kv_cache
        self.spec = spec

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> AttentionMetadata:
        """Precompute what every layer of this step shares."""

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] for the step's new tokens -> output [T, Hq, D]. rope: the
        step's rotary embedding, applied to q and k first (None: they come rotated, or the model has none)."""

    def plan_decodes_and_prefills(
        self,
        batch: AttentionBatch,
        plan_decode: Callable[[AttentionBatch], AttentionMetadata],
        plan_prefill: Callable[[AttentionBatch], AttentionMetadata],
    ) -> AttentionMetadata:
        """A step of decodes only, of prefill chunks only, or both (MixedMetadata), planned by the two."""
        decodes = leading_single_token_rows(batch)
        if decodes == batch.num_seqs:
            return plan_decode(batch)
        if decodes == 0:
            return plan_prefill(batch)
        head, tail = split_batch(batch, decodes)
        return MixedMetadata(backend=self, batch=batch, decode=plan_decode(head), prefill=plan_prefill(tail),
                             decode_tokens=decodes)  # fmt: skip

    def attend_mixed(
        self, layer_idx: int, q: torch.Tensor, meta: MixedMetadata, out: torch.Tensor | None
    ) -> torch.Tensor:
        """A mixed step's attention: its decode rows, then its prefill rows, each into its part of out."""
        n = meta.decode_tokens
        out = torch.empty_like(q) if out is None else out
        self.attend(layer_idx, q[:n], meta.decode, out[:n])
        self.attend(layer_idx, q[n:], meta.prefill, out[n:])
        return out

    def decode_kernel_name(self) -> str:
        """What runs decode steps (for the start-up log): the backend's own kernels unless it says."""
        return self.name

    def attend(
        self, layer_idx: int, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The attention alone, q [T, Hq, D] rotated, over a cache that already holds the step's K/V;
        written into out (contiguous, q's shape and dtype) when given."""
        raise NotImplementedError(f"the {self.name} attention backend does not attend apart from forward")

    def capture_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        """Metadata for a CUDA-graphed decode batch (one new token per sequence) whose device tensors
        are persistent buffers of fixed shape, updated in place between replays. Called once before
        capture; the captured kernels keep reading the same tensors."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in CUDA graphs")

    def prepare_replay(self, meta: AttentionMetadata, batch: AttentionBatch) -> None:
        """Refresh host-planned state before a replay; batch holds the step's host lists and the same
        persistent device tensors as at capture. Nothing to do where the kernels read only those."""
        if not self.supports_cuda_graphs:
            raise NotImplementedError(f"the {self.name} attention backend cannot be captured in CUDA graphs")
