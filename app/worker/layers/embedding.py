"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> float32 logits. With tied embeddings the weight is the embedding's parameter itself,
    so the checkpoint's lm_head tensor (if any) is redundant."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tied: VocabEmbedding | None) -> None:
        super().__init__()
        self.tied = tied is not None
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden, dtype=dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
