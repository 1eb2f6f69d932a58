"""Acceptance of drafts (app/worker/spec/verify.py) and n-gram lookup (app/worker/spec/ngram.py).

The statistics: with drafts, the tokens a step emits must be distributed exactly as the target's p
(chi-square at the 0.001 level, fixed seeds, a 6-token vocabulary), for a deterministic draft (n-gram)
and for a sampled one (a model draft with its own q).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.worker.spec.ngram import NgramProposer, lookup
from app.worker.spec.proposer import TargetStep
from app.worker.spec.verify import accept_greedy, accept_sampled, target_probs
from tests.unit.test_sampling_flashinfer import goodness_of_fit

V, N = 6, 20000
P = torch.tensor([0.05, 0.4, 0.25, 0.15, 0.1, 0.05])  # the target's distribution at every position
Q = torch.tensor([0.3, 0.1, 0.1, 0.3, 0.1, 0.1])  # a model draft's


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_accepts_the_longest_matching_prefix_then_the_argmax() -> None:
    # Row 1 fed [t, 5, 6, 7]: the target's argmax is 5, 6, 9, 4 at its positions.
    out = accept_greedy([5, 6, 9, 4, 1, 2], [[5, 6, 7], [3]])
    assert (out[0].tokens, out[0].next_token) == ([5, 6], 9)
    assert (out[1].tokens, out[1].next_token) == ([], 1)
    assert accept_greedy([5, 6, 7, 8], [[5, 6, 7]])[0].tokens == [5, 6, 7]


def emitted(out: list, index: int) -> np.ndarray:
    """Counts of the index-th token of the rows that emitted that many (accepted drafts, then the next
    token). The second token is counted where the first draft was kept: given that, it must be p too
    (here p does not depend on the context; a rejected row's next token comes from the next step)."""
    tokens = [(row.tokens + [row.next_token])[index] for row in out if len(row.tokens) >= index]
    return np.bincount(tokens, minlength=V)


@pytest.mark.parametrize("draft_token", [1, 5])
def test_deterministic_draft_keeps_the_target_distribution(draft_token: int) -> None:
    """n-gram drafts: a likely and an unlikely draft; the first and second emitted tokens are each p."""
    probs = P.repeat(N * 3, 1)  # each row fed [t, d, d]: three positions
    out = accept_sampled(probs, [[draft_token, draft_token]] * N, gen(0))
    for index in (0, 1):
        stat, critical = goodness_of_fit(emitted(out, index), P.double())
        assert stat < critical, (index, stat, critical)
    accepted = np.mean([len(row.tokens) > 0 for row in out])
    assert abs(accepted - float(P[draft_token])) < 0.02  # a draft d is kept with probability p(d)


def test_sampled_draft_keeps_the_target_distribution() -> None:
    """Model drafts drawn from q, accepted with min(1, p/q), the residual max(0, p - q) on rejection."""
    drafts = torch.multinomial(Q, N * 2, replacement=True, generator=gen(1)).view(N, 2).tolist()
    out = accept_sampled(P.repeat(N * 3, 1), drafts, gen(2), draft_probs=Q.repeat(N * 2, 1))
    for index in (0, 1):
        stat, critical = goodness_of_fit(emitted(out, index), P.double())
        assert stat < critical, (index, stat, critical)


def test_the_check_can_fail() -> None:
    """Accepting every draft (no rejection sampling) is caught: the test above has power."""
    probs = P.repeat(N * 2, 1)
    out = accept_sampled(probs, [[5]] * N, gen(0), draft_probs=torch.full((N, V), 1e-9))  # ratio huge: all kept
    stat, critical = goodness_of_fit(emitted(out, 0), P.double())
    assert stat > critical


def test_target_probs_match_the_samplers_processing() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]] * 3)
    t = torch.tensor([0.5, 1.0, 2.0])
    top_k = torch.tensor([2, V, V])
    top_p = torch.tensor([1.0, 0.6, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.2])
    probs = target_probs(logits, t, top_k, top_p, min_p)
    first = torch.softmax(torch.tensor([4.0, 2.0]), 0)
    torch.testing.assert_close(probs[0, :2], first)
    assert probs[0, 2:].sum() == 0
    kept = torch.softmax(logits[1], 0).cumsum(0)
    assert (probs[1] > 0).sum() == int((kept - torch.softmax(logits[1], 0) < 0.6).sum())
    row = torch.softmax(logits[2] / 2.0, 0)
    assert torch.equal(probs[2] > 0, row >= 0.2 * row.max())
    torch.testing.assert_close(probs.sum(1), torch.ones(3))


# ---------------------------------------------------------------- n-gram lookup


def test_lookup_prefers_the_longest_then_the_latest_match() -> None:
    assert lookup([1, 2, 3, 4, 1, 2, 3], 1, 12, 3) == [4, 1, 2]
    # "2 3" occurs twice before the end, followed by 9 then by 5: the latest wins.
    assert lookup([1, 2, 3, 9, 2, 3, 5, 2, 3], 1, 12, 2) == [5, 2]
    # "8 2 3" is longer than the latest "2 3".
    assert lookup([8, 2, 3, 7, 6, 2, 3, 5, 8, 2, 3], 1, 12, 2) == [7, 6]
    assert lookup([5, 6, 7], 1, 12, 3) == []
    assert lookup([1, 7, 7], 2, 12, 3) == []  # the only match is one token long
    assert lookup([1, 7, 7], 1, 12, 3) == [7]  # a match near the end drafts what there is


def test_proposer_follows_the_slots_tokens() -> None:
    proposer = NgramProposer(1, 4)
    proposer.register(0, [1, 2, 3, 4])
    proposer.register(1, [9, 9])
    draft = proposer.propose([0, 1], 2)
    assert draft.lengths == [0, 1] and draft.token_ids[1, 0] == 9
    proposer.observe(TargetStep([0], [[4]], [3], [1], [[1, 2]]))
    draft = proposer.propose([0], 3)
    assert draft.lengths == [3] and draft.token_ids[0].tolist() == [3, 4, 1]
    proposer.release(0)
    with pytest.raises(KeyError):
        proposer.propose([0], 1)


def test_decoder_accepts_greedy_rows_and_flags_bad_logits() -> None:
    """SpecDecoder._accept over two verify rows: the longest matching prefix, the argmax after it, and a
    row whose logits hold a NaN flagged bad (its neighbour is not)."""
    from app import protocol as p
    from app.worker.spec.decoder import SpecDecoder, VerifyRows

    decoder = SpecDecoder(NgramProposer(1, 3), block_size=4, device=torch.device("cpu"), vocab_size=V, seed=0)
    for slot in (0, 1):
        decoder.register(p.NewSeq(slot, f"r{slot}", p.SamplingParams(temperature=0.0), 3, [0], prompt_ids=[1, 2, 3]))
    verify = VerifyRows(slots=[0, 1], drafts=[[4, 5], [2]], draft_probs=[None, None])
    argmax = [4, 1, 3, 2, 0]  # row 0: 4 kept, 5 refused (the target says 1); row 1: 2 kept
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), V).float()
    logits[4, 1] = float("nan")
    out = decoder._accept(logits, verify)
    assert out.accepted == [[4], [2]] and out.next_tokens[0] == 1  # row 1's next token is NaN's argmax
    assert out.bad == [False, True]
