"""Logprobs of sampled tokens and their top alternatives, for the rows that ask for them.

Definition (both samplers): log_softmax of the processed logits, that is after logit_bias, the
min_new_tokens mask and the repetition / presence / frequency penalties, and before temperature,
top-k, top-p and min-p. The numbers therefore describe the model's (penalised) distribution and do
not change with the sampling temperature. Tokens masked by min_new_tokens have logprob -inf.
They are computed as device work (DeviceLogprobs) and read back with the step's tokens, so a step
that asks for logprobs does not wait for the device either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from app.protocol import TokenLogprobs


@dataclass(slots=True)
class DeviceLogprobs:
    """Logprobs of the rows that asked for them, still on the device, so that sampling never waits for
    the device: `packed` is one float64 tensor [chosen ids (n), their logprobs (n), top ids (n x widest),
    top logprobs (n x widest)] (ids < 2**53 are exact in float64) that the caller copies to the host
    with the step's tokens, then unpack()s."""

    rows: np.ndarray  # the batch rows that asked, ascending
    top_counts: np.ndarray  # alternatives per row of `rows`
    packed: torch.Tensor

    def unpack(
        self, host: np.ndarray, batch_size: int, bad_rows: Iterable[int] = ()
    ) -> list[TokenLogprobs | None]:
        """TokenLogprobs per batch row from `host` (packed, read back); None for rows that did not ask
        and for bad rows (their logits were NaN/inf: nothing meaningful to report)."""
        result: list[TokenLogprobs | None] = [None] * batch_size
        n = len(self.rows)
        widest = int(self.top_counts.max())
        ids, values = host[:n].astype(np.int64), host[n : 2 * n]
        top_ids = host[2 * n : 2 * n + n * widest].reshape(n, widest).astype(np.int64)
        top_values = host[2 * n + n * widest :].reshape(n, widest)
        for i, row in enumerate(self.rows.tolist()):
            k = int(self.top_counts[i])
            result[row] = TokenLogprobs(
                token_id=int(ids[i]),
                logprob=float(values[i]),
                top_ids=top_ids[i, :k].tolist(),
                top_logprobs=top_values[i, :k].tolist(),
            )
        for row in bad_rows:
            result[row] = None
        return result


def gather_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rows: np.ndarray,
    rows_dev: torch.Tensor,
    top_counts: np.ndarray,
) -> DeviceLogprobs | None:
    """The logprobs of `rows` (top_counts[i] alternatives each) as device work; None if no row asks.

    logits: [B, V] processed logits (any float dtype); tokens: [B] sampled ids; rows_dev: `rows` on the device.
    The top alternatives are sorted by logprob, highest first. Nothing here waits for the device.
    """
    if not len(rows):
        return None
    logprobs = torch.log_softmax(logits.index_select(0, rows_dev).float(), dim=-1)
    chosen = tokens.index_select(0, rows_dev)
    parts = [chosen.to(torch.float64), logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).to(torch.float64)]
    widest = int(top_counts.max())
    if widest:
        top_values, top_ids = logprobs.topk(widest, dim=-1)
        parts += [top_ids.to(torch.float64).flatten(), top_values.to(torch.float64).flatten()]
    return DeviceLogprobs(np.asarray(rows, dtype=np.int64), np.asarray(top_counts), torch.cat(parts))
