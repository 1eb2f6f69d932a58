"""Random draws for sampling: the exponential race (Gumbel-max) with per-sequence generators.

Sampling token i with probability softmax(x)_i is argmax_i(x_i - log E_i) with E_i ~ Exp(1) drawn
independently: one [V] draw per row, no cumulative sums, and masked (-inf) tokens can never win.

A seeded sequence draws its row from a device generator re-seeded from (seed, position), where
position is the number of tokens it has output so far: the token at a position depends only on the
seed, the position and the row's logits, whatever else is in the batch, whatever the row's index,
and across a preemption (no draws to replay, as a generator advanced once per token would need).
Since every draw re-seeds it, one generator serves all seeded rows. Unseeded rows share another
generator, seeded from the process-wide seed, so that runs are reproducible too.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit generator seed for output `position` of a sequence seeded with `seed`.

    All 64 bits are mixed (CPU generators use only the low 32, CUDA's Philox all 64).
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 1


def gumbel_noise(
    vocab_size: int,
    num_shared: int,
    shared: torch.Generator,
    seeded: torch.Generator,
    seeds: list[int],
) -> torch.Tensor:
    """[num_shared + len(seeds), V] float32 Gumbel noise, -log(E) with E ~ Exp(1).

    The first num_shared rows come from `shared` in one draw; then `seeded`, re-seeded with each of
    `seeds`, fills one row each (a contiguous [V] draw, whose values do not depend on where the
    row lies: a test checks it on every device it runs on). Both generators are on the device.
    """
    noise = torch.empty((num_shared + len(seeds), vocab_size), dtype=torch.float32, device=shared.device)
    if num_shared:
        noise[:num_shared].exponential_(generator=shared)
    for i, seed in enumerate(seeds):
        seeded.manual_seed(seed)
        noise[num_shared + i].exponential_(generator=seeded)
    # E == 0 would give +inf noise: clamp so a zero-probability (-inf) token can never win.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_()
