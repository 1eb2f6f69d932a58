"""Logprobs of sampled tokens and their top alternatives, for the rows that ask for them.

Definition (both samplers): log_softmax of the processed logits, that is after logit_bias, the
min_new_tokens mask and the repetition / presence / frequency penalties, and before temperature,
top-k, top-p and min-p. The numbers therefore describe the model's (penalised) distribution and do
not change with the sampling temperature. Tokens masked by min_new_tokens have logprob -inf.
"""

from __future__ import annotations

import numpy as np
import torch

from app.protocol import TokenLogprobs


def gather_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rows: np.ndarray,
    rows_dev: torch.Tensor,
    top_counts: np.ndarray,
    batch_size: int,
) -> list[TokenLogprobs | None]:
    """TokenLogprobs for each of `rows` (top_counts[i] alternatives), None for the other rows.

    logits: [B, V] processed logits (any float dtype); tokens: [B] sampled ids; rows_dev: `rows` on the device.
    The top alternatives are sorted by logprob, highest first. Costs one device-to-host transfer.
    """
    result: list[TokenLogprobs | None] = [None] * batch_size
    if not len(rows):
        return result
    logprobs = torch.log_softmax(logits.index_select(0, rows_dev).float(), dim=-1)
    chosen = tokens.index_select(0, rows_dev)
    parts = [chosen.to(torch.float64), logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).to(torch.float64)]
    widest = int(top_counts.max())
    if widest:
        top_values, top_ids = logprobs.topk(widest, dim=-1)
        parts += [top_ids.to(torch.float64).flatten(), top_values.to(torch.float64).flatten()]
    host = torch.cat(parts).cpu().numpy()  # ids < 2**53 are exact in float64
    n = len(rows)
    ids, values = host[:n].astype(np.int64), host[n : 2 * n]
    top_ids = host[2 * n : 2 * n + n * widest].reshape(n, widest).astype(np.int64)
    top_values = host[2 * n + n * widest :].reshape(n, widest)
    for i, row in enumerate(rows.tolist()):
        k = int(top_counts[i])
        result[row] = TokenLogprobs(
            token_id=int(ids[i]),
            logprob=float(values[i]),
            top_ids=top_ids[i, :k].tolist(),
            top_logprobs=top_values[i, :k].tolist(),
        )
    return result
