"""Token embedding and the LM head (which may share the embedding's weight).

With tensor parallelism both are vocab-parallel: each rank holds ceil(vocab / tp) rows (the last rank's
tail is zero padding). The embedding looks up the ids in its range and all-reduces; the LM head computes
its range of logits and all-gathers them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from app.worker.layers.linear import TPSlice, linear, mark_tp_slices
from app.worker.parallel import SINGLE, TensorParallel


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = math.ceil(vocab_size / tp.size)
        self.first = tp.rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden, dtype=dtype))
        if tp.size > 1:
            held = max(0, min(vocab_size, self.first + self.rows) - self.first)
            mark_tp_slices(self.weight, {None: TPSlice(0, self.first, held, vocab_size)})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(nn.Module):
    """hidden -> logits in the model dtype, as the matmul rounds them (a float32 copy would hold the same
    values: samplers upcast where they compute). With tied embeddings the weight is the embedding's
    parameter itself, so the checkpoint's lm_head tensor (if any) is redundant; on a CPU with native
    half matmuls the head then multiplies by a prepacked copy of it (`packed`, app/worker/layers/
    cpu_weights.py), as the lookup needs the plain table."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        dtype: torch.dtype,
        tied: VocabEmbedding | None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tied = tied is not None
        self.tp = tp
        self.vocab_size = vocab_size
        self.packed: torch.Tensor | None = None
        if tied is not None:
            self.weight = tied.weight
        else:
            rows = math.ceil(vocab_size / tp.size)
            self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype))
            if tp.size > 1:
                first = tp.rank * rows
                held = max(0, min(vocab_size, first + rows) - first)
                mark_tp_slices(self.weight, {None: TPSlice(0, first, held, vocab_size)})

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, H] -> logits [B, vocab], written into `out` when given (a CUDA graph's static
        buffer: no copy of a [B, vocab] temporary)."""
        head = self.weight if self.packed is None else self.packed
        if self.tp.size == 1 and not head.is_mkldnn:
            return torch.mm(hidden, head.t(), out=out)
        logits = linear(hidden, head)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last(logits)[..., : self.vocab_size]
        return logits.contiguous() if out is None else out.copy_(logits)
